"""parallax_tf: train a single-device tf.compat.v1 graph on many ranks.

    result = parallax_tf.run(model_fn, input_fn, steps=100, strategy="hybrid")
"""
import sys as _sys

from parallax_tf.runtime import exit as _exit, launch as _launch, quiet as _quiet

_exit.install()                   # a user error on the command line: one line, exit status 2
_launch.launch_if_asked(_sys.argv)    # --np N: the ranks start here, before TensorFlow is imported
_quiet.prefer_quiet_tensorflow(_sys.argv)   # these two only help when parallax_tf comes before TensorFlow
with _quiet.tensorflow_import(_sys.argv):
    from parallax_tf.api import run  # noqa: E402
from parallax_tf.errors import ClusterError, ConfigError, Diverged, InputError, ModelError, ParallaxError  # noqa: E402
from parallax_tf.model import Model, Result, RunContext  # noqa: E402
from parallax_tf.plan import Plan, Shard, VariablePlan  # noqa: E402

__all__ = ["run", "Model", "Result", "RunContext", "Plan", "Shard", "VariablePlan", "ParallaxError",
           "ModelError", "InputError", "ConfigError", "ClusterError", "Diverged"]
