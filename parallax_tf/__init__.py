"""parallax_tf: train a single-device tf.compat.v1 graph on many ranks.

    result = parallax_tf.run(model_fn, input_fn, steps=100, strategy="hybrid")
"""
import os as _os
import sys as _sys

from parallax_tf.runtime import bind as _bind, command_line as _command_line, exit as _exit, launch as _launch, \
    quiet as _quiet, script_args as _script_args

_exit.install()                   # a user error on the command line: one line, exit status 2
_command_line.install()           # and so is a flag error under absl's app.run
_launch.launch_if_asked(_sys.argv)    # --np N: the ranks start here, before TensorFlow is imported
if _launch.under_launcher():
    _bind.preload_before_tensorflow()     # horovodrun's or mpirun's rank: the bind shim, before TF too
_script_args.separate_script_arguments()     # the script's own arguments, behind `--`, for its own parser
# tf.keras and tf.compat.v1.layers as Keras 2 (tf_keras, installed by the set-up): Keras 3 layers
# never update batch norm in a v1 graph, and tf.compat.v1.layers refuses to run under it. Read by
# TensorFlow at its import; a user's own setting wins.
_os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
_quiet.prefer_quiet_tensorflow(_sys.argv)   # these two only help when parallax_tf comes before TensorFlow
with _quiet.tensorflow_import(_sys.argv):
    from parallax_tf.api import run  # noqa: E402
    from parallax_tf.fit import fit  # noqa: E402
    from parallax_tf.export import export_saved_model  # noqa: E402
    from parallax_tf import dynamic  # noqa: E402
    from parallax_tf.dynamic import DynamicEmbedding  # noqa: E402
    from parallax_tf import keras, tf_keras  # noqa: E402
from parallax_tf.errors import ClusterError, ConfigError, Diverged, InputError, ModelError, ParallaxError  # noqa: E402
from parallax_tf.model import Model, Result, RunContext  # noqa: E402
from parallax_tf.rank_run import rank, size  # noqa: E402
from parallax_tf.plan import Plan, Shard, VariablePlan  # noqa: E402

__all__ = ["run", "fit", "export_saved_model", "DynamicEmbedding", "dynamic", "keras", "tf_keras", "rank", "size", "Model", "Result",
           "RunContext", "Plan", "Shard", "VariablePlan",
           "ParallaxError", "ModelError", "InputError", "ConfigError", "ClusterError", "Diverged"]
