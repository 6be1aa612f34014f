"""parallax_tf: train a single-device tf.compat.v1 graph on many ranks.

    result = parallax_tf.run(model_fn, input_fn, steps=100, strategy="hybrid")
"""
import sys as _sys

from parallax_tf.runtime.quiet import prefer_quiet_tensorflow as _prefer_quiet_tensorflow

_prefer_quiet_tensorflow(_sys.argv)   # only helps when parallax_tf is imported before TensorFlow
from parallax_tf.api import run  # noqa: E402
from parallax_tf.errors import ClusterError, ConfigError, Diverged, InputError, ModelError, ParallaxError  # noqa: E402
from parallax_tf.model import Model, Result, RunContext  # noqa: E402
from parallax_tf.plan import Plan, Shard, VariablePlan  # noqa: E402

__all__ = ["run", "Model", "Result", "RunContext", "Plan", "Shard", "VariablePlan", "ParallaxError",
           "ModelError", "InputError", "ConfigError", "ClusterError", "Diverged"]
