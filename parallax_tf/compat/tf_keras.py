"""Every private tf_keras name the toolkit uses, in one place: `tf_keras.src.*` modules (the
optimizer base classes whose apply_gradients is recorded, the Layer/Model base-class swap,
the graph-op layer switch), a compiled model's own record of compile, and the legacy
optimizers' state. Each name is pinned (PINNED, checked by tests/test_compat.py on the
installed tf_keras), so a name that moves in a new release is found here, by name, rather than
in a run that fails.

Imports tf_keras only inside the functions that need it (`import parallax_tf` does not import
it); where tf_keras is optional, a function says what it gives without it."""
from __future__ import annotations

import contextlib
import copy
from typing import List, Tuple

from parallax_tf.compat import pins

# (where it lives, name, what the toolkit uses it for); a `where` ending in "()" is an instance
PINNED: List[Tuple[str, str, str]] = [
    ("tf_keras.src.optimizers.legacy.optimizer_v2", "OptimizerV2",
     "legacy optimizers: their apply_gradients recorded (training_graph.py)"),
    ("tf_keras.src.optimizers.optimizer", "Optimizer",
     "new optimizers: their apply_gradients recorded to name them (training_graph.py)"),
    ("tf_keras.src.engine.base_layer_utils", "_UNSAFE_GRAPH_OP_LAYER_CREATION",
     "constants between functional layers kept in the graph (training_graph.py)"),
    ("tf_keras.src.engine.base_layer", "Layer", "the eager model's classes back on the v2 bases (fit/spec.py)"),
    ("tf_keras.src.engine.base_layer_v1", "Layer", "the same"),
    ("tf_keras.src.engine.training", "Model", "the same"),
    ("tf_keras.src.engine.training_v1", "Model", "the same"),
    ("tf_keras.src.utils.version_utils", "swap_class", "the same"),
    ("tf_keras.Model", "_flatten_layers", "the same: every layer of a model"),
    ("tf_keras.Model()", "_is_compiled", "whether a model was compiled (fit/spec.py)"),
    ("tf_keras.Model()", "_compile_config", "compile's own arguments (fit/spec.py)"),
    ("tf_keras.Model()", "_is_graph_network", "a functional model, not a subclassed one (fit/spec.py)"),
    ("tf_keras.__internal__.optimizers", "convert_to_legacy_optimizer",
     "compile's new optimizer as its legacy twin (fit/spec.py)"),
    ("tf_keras.src.backend", "get_default_graph_uid_map",
     "layer-name counters: a model rebuilt by the script's function names its layers as it did eagerly (fit/spec.py)"),
    ("tf_keras.src.losses", "LossFunctionWrapper",
     "a loss given to compile as a function, wrapped as compile wraps it (fit/graph.py)"),
    ("tf_keras.optimizers.legacy.Optimizer()", "_slots",
     "a legacy optimizer's copy with state of its own (rewriters/slim_dp)"),
    ("tf_keras.optimizers.legacy.Optimizer()", "_weights", "the same"),
    ("tf_keras.optimizers.legacy.Optimizer()", "_iterations", "the same"),
    ("tf_keras.optimizers.legacy.Optimizer()", "_deferred_slot_restorations", "the same"),
    ("tf_keras.optimizers.legacy.Optimizer()", "_initial_decay",
     "a legacy optimizer's settings outside its hyper-parameters: a dynamic table's row rule (dynamic/rules.py)"),
    ("tf_keras.optimizers.legacy.Optimizer()", "_momentum", "the same"),
    ("tf_keras.optimizers.legacy.Ftrl()", "_initial_accumulator_value", "the same"),
    ("tf_keras.optimizers.legacy.Ftrl()", "_l2_shrinkage_regularization_strength", "the same"),
    ("tf_keras.Model", "_flatten_layers", "a fit model's dynamic layers (fit/spec.py)"),
    ("tf_keras.optimizers.legacy.Optimizer()", "_hyper",
     "a legacy optimizer's hyper-parameter variables, which a TF2 step reads as constants (tf2/fixed.py)"),
    ("tf_keras.optimizers.Optimizer()", "_learning_rate", "a new optimizer's learning-rate variable: the same"),
]


def _samples() -> dict:
    import tf_keras

    def compiled_model():
        model = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(2,))])
        model.compile("sgd", "mse")
        return model
    return {"tf_keras.Model()": compiled_model,
            "tf_keras.optimizers.legacy.Optimizer()": tf_keras.optimizers.legacy.SGD,
            "tf_keras.optimizers.legacy.Ftrl()": tf_keras.optimizers.legacy.Ftrl,
            "tf_keras.optimizers.Optimizer()": tf_keras.optimizers.SGD}


def missing() -> List[str]:
    """The pinned names this tf_keras does not have, as where.name."""
    return pins.unresolved(PINNED, _samples())


# ---- optimizers -------------------------------------------------------------------------------

def legacy_optimizer_class():
    """tf_keras' OptimizerV2 (tf_keras.optimizers.legacy.*); None without tf_keras."""
    try:
        from tf_keras.src.optimizers.legacy import optimizer_v2
    except ImportError:
        return None
    return optimizer_v2.OptimizerV2


def new_optimizer_class():
    """tf_keras' new Optimizer base class (tf_keras.optimizers.*); None without tf_keras."""
    try:
        from tf_keras.src.optimizers import optimizer
    except ImportError:
        return None
    return optimizer.Optimizer


LEGACY_SETTINGS = {"decay": "_initial_decay", "momentum": "_momentum",
                   "initial_accumulator_value": "_initial_accumulator_value",
                   "l2_shrinkage_regularization_strength": "_l2_shrinkage_regularization_strength"}


def legacy_optimizer_settings(optimizer) -> dict:
    """A legacy tf_keras optimizer's settings kept beside its hyper-parameters, by their public
    names: decay, whether SGD has momentum (a bool), Adagrad's and Ftrl's initial accumulator,
    Ftrl's L2 shrinkage (those it has); {} for any other optimizer."""
    legacy = legacy_optimizer_class()
    if legacy is None or not isinstance(optimizer, legacy):
        return {}
    return {name: getattr(optimizer, private) for name, private in LEGACY_SETTINGS.items()
            if hasattr(optimizer, private)}


def hyper_parameter_variables(optimizer) -> list:
    """The variables holding a tf_keras optimizer's hyper-parameters (a legacy one's learning
    rate, beta, l1, ..., a new one's learning rate), where it made them; [] for any other."""
    legacy, new = legacy_optimizer_class(), new_optimizer_class()
    if legacy is not None and isinstance(optimizer, legacy):
        return list(optimizer._hyper.values())
    if new is not None and isinstance(optimizer, new):
        return [optimizer._learning_rate]
    return []


def layers_of(model) -> list:
    """Every layer of a tf_keras model, nested ones too."""
    return list(model._flatten_layers(include_self=False))


def to_legacy_optimizer(optimizer):
    """A new tf_keras optimizer's legacy twin (same class and settings)."""
    import tf_keras
    return tf_keras.__internal__.optimizers.convert_to_legacy_optimizer(optimizer)


def fresh_legacy_copy(optimizer):
    """A copy of a legacy tf_keras optimizer (same hyper-parameters, read without a session)
    with slots, weights and iterations of its own."""
    clone = copy.copy(optimizer)
    clone._slots, clone._weights, clone._iterations, clone._deferred_slot_restorations = {}, [], None, {}
    return clone


# ---- layers and models --------------------------------------------------------------------------

@contextlib.contextmanager
def graph_op_layers_keep_constants():
    """Within: a raw TF op between functional layers keeps a constant input as the graph tensor
    it is (tf_keras' own switch); nothing without tf_keras."""
    try:
        from tf_keras.src.engine import base_layer_utils
    except ImportError:
        yield
        return
    saved = base_layer_utils._UNSAFE_GRAPH_OP_LAYER_CREATION
    base_layer_utils._UNSAFE_GRAPH_OP_LAYER_CREATION = True
    try:
        yield
    finally:
        base_layer_utils._UNSAFE_GRAPH_OP_LAYER_CREATION = saved


def is_compiled(model) -> bool:
    return getattr(model, "_is_compiled", False)


def compile_config(model) -> dict:
    """The arguments model.compile was called with."""
    return dict(model._compile_config.config)


def is_graph_network(model) -> bool:
    """Whether `model` is a graph of layers (functional or Sequential), not a subclassed one."""
    return getattr(model, "_is_graph_network", False)


def classes_on_v2_bases(model) -> None:
    """`model`'s class and its layers' classes put back on tf_keras' v2 Model and Layer bases
    (tf_keras rewrites a class's __bases__ to the v1 or v2 ones each time one is made)."""
    from tf_keras.src.engine import base_layer, base_layer_v1, training, training_v1
    from tf_keras.src.utils.version_utils import swap_class
    for layer in [model, *model._flatten_layers(include_self=False)]:
        swap_class(type(layer), training.Model, training_v1.Model, use_v2=True)
        swap_class(type(layer), base_layer.Layer, base_layer_v1.Layer, use_v2=True)


def loss_function_wrapper(function):
    """`function(y_true, y_pred)` as the Loss compile makes of it (it matches the target's rank to
    the prediction's before calling)."""
    from tf_keras.src.losses import LossFunctionWrapper
    return LossFunctionWrapper(function)


def layer_name_counters() -> dict:
    """How many objects of each name tf_keras has named in the current default graph (eagerly:
    the process's), which decides the next layer's name (`dense_4`)."""
    from tf_keras.src import backend
    return dict(backend.get_default_graph_uid_map())


def continue_layer_names(counters: dict) -> None:
    """Layers made next in the current default graph are named as they were after `counters`."""
    from tf_keras.src import backend
    uids = backend.get_default_graph_uid_map()
    uids.clear()
    uids.update(counters)
