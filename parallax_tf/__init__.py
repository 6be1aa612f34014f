"""parallax_tf: train a single-device tf.compat.v1 graph on many ranks.

    result = parallax_tf.run(model_fn, input_fn, steps=100, strategy="hybrid")
"""
from parallax_tf.api import run
from parallax_tf.errors import ClusterError, ConfigError, InputError, ModelError, ParallaxError
from parallax_tf.model import Model, Result, RunContext
from parallax_tf.plan import Plan, Shard, VariablePlan

__all__ = ["run", "Model", "Result", "RunContext", "Plan", "Shard", "VariablePlan", "ParallaxError",
           "ModelError", "InputError", "ConfigError", "ClusterError"]
