"""What recording a model_fn's training (parallax_tf.training_graph) needs to know of tf_keras:
its optimizer classes (the legacy ones train in a tf.compat.v1 graph, the new ones do not) and
how a message names an optimizer, the tf_keras layer creating a variable, and tf_keras' switch
that keeps a functional model's constants in the graph."""
from __future__ import annotations

import sys

import tensorflow as tf

from parallax_tf.compat import tf_keras as keras_shim
from parallax_tf.errors import ModelError


def legacy_keras_optimizer_class():
    """tf_keras' OptimizerV2 (tf_keras.optimizers.legacy.*), when tf_keras is installed (imported
    here, 0.1 s, so that a model_fn importing it itself is recorded too)."""
    return keras_shim.legacy_optimizer_class()


def new_keras_optimizer_class():
    """tf_keras' new Optimizer base class (tf_keras.optimizers.*), when tf_keras is installed."""
    return keras_shim.new_optimizer_class()


def is_legacy_keras_optimizer(optimizer) -> bool:
    keras_class = legacy_keras_optimizer_class()
    return keras_class is not None and isinstance(optimizer, keras_class)


def describe_optimizer(optimizer) -> str:
    """"tf_keras Adam", "Keras 3 Adam", "tf.compat.v1.train AdamOptimizer": what a message names."""
    module, name = type(optimizer).__module__, type(optimizer).__name__
    if module.startswith("tf_keras"):
        return f"tf_keras {'legacy ' if is_legacy_keras_optimizer(optimizer) else ''}{name}"
    if module.startswith("keras"):
        return f"Keras 3 {name}"
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        return f"tf.compat.v1.train {name}"
    return f"{module}.{name}"


def keras_constants_stay_in_the_graph():
    """A raw TF op between tf_keras functional layers with a constant input (tf.reshape(x, [-1, 2, 4]))
    makes tf_keras evaluate that constant in a session of its own (backend.get_session), which
    initialises every variable built so far, on devices that session does not have. tf_keras'
    own switch keeps the constant as the graph tensor it is instead."""
    return keras_shim.graph_op_layers_keep_constants()


def creating_layer():
    """The innermost tf_keras layer whose code is creating a variable right now, if any.
    A Keras 3 layer (the `keras` package) gets a clear error instead."""
    frame = sys._getframe(2)
    for _ in range(60):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        module = type(owner).__module__ if owner is not None else ""
        if module.startswith("keras.") or module == "keras":
            raise ModelError(
                f"model_fn built a Keras 3 object ({type(owner).__module__}.{type(owner).__name__}) (the `keras` "
                "package; tf.keras too where TensorFlow was imported before parallax_tf or TF_USE_LEGACY_KERAS "
                "is off), whose layers in a tf.compat.v1 graph never update batch-norm statistics. Use Keras 2: "
                "`import tf_keras` (tf_keras.layers, tf_keras.Sequential), or tf.keras with parallax_tf "
                "imported before TensorFlow")
        if module.startswith("tf_keras") and any(c.__name__ == "Layer" for c in type(owner).__mro__):
            return owner
        frame = frame.f_back
    return None
