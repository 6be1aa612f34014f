"""What a single-device script compiled: the model to rebuild in the toolkit's graph, its
starting weights and compile's choices (optimizer, loss, metrics)."""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.compat import tf_keras as keras_shim
from parallax_tf.dynamic import layer as dynamic_layer
from parallax_tf.errors import ConfigError, ModelError


class KerasSpec:
    """A compiled tf_keras model (or a function returning one) read once, eagerly."""

    def __init__(self, model, built=None, name_counters: Optional[dict] = None):
        """`model`: a compiled model or a function building one; `built`: what that function
        already returned, and `name_counters` tf_keras' layer-name counters before it ran."""
        import tf_keras
        self.builder: Optional[Callable] = None
        self._name_counters: dict = name_counters or {}     # tf_keras' layer names before the function built it
        if not isinstance(model, tf_keras.Model) and callable(model):
            if built is None:
                self._name_counters = keras_shim.layer_name_counters()
            self.builder, model = model, (built if built is not None else model())
        if not isinstance(model, tf_keras.Model):
            raise ModelError(f"ptf.fit takes a compiled tf_keras model or a function returning one; got "
                             f"{type(model).__name__}")
        if not keras_shim.is_compiled(model):
            raise ModelError("ptf.fit needs a compiled model: call model.compile(optimizer=..., loss=...) first")
        self.model = model
        self.compiled = keras_shim.compile_config(model)
        # a subclassed model has no graph of layers to clone: the function form builds it and
        # the toolkit calls it on placeholders named after x's keys (or "x")
        self.subclassed = not keras_shim.is_graph_network(model)
        if self.subclassed and self.builder is None:
            raise ModelError(f"ptf.fit takes a subclassed model ({type(model).__name__}) through a function that "
                             "builds and compiles it: ptf.fit(make_model, x, y, ...)")
        self.input_names = [] if self.subclassed else list(model.input_names)
        self.output_names = ["output_1"] if self.subclassed else list(model.output_names)
        self.weights: List[Tuple[str, np.ndarray]] = []      # the eager model's (name, value), in its order
        self.graph_names: Dict[int, str] = {}                 # index into weights -> its variable's name
        chosen = self.compiled.get("optimizer") or "rmsprop"
        legacy = _legacy_optimizer(chosen)
        self._converted = legacy is not chosen      # from a string or a new Keras optimizer
        self._optimizer = _dividing_as_the_new_one(legacy, self._converted)

    def adopt(self, x) -> None:
        """Reads the eager model's starting weights, building a subclassed model first on x (a
        batch's inputs, as Keras builds it on fit's first batch)."""
        if self.subclassed:
            self.input_names = sorted(x) if isinstance(x, dict) else ["x"]
            if not self.model.built:
                self.model(x if isinstance(x, dict) else np.asarray(x))
        self.weights = [(weight_name(w), w.numpy()) for w in self._trained_weights()]

    def _trained_weights(self) -> list:
        """The eager model's weights the rebuilt one trains: not a dynamic layer's live rows,
        whose table the toolkit's graph holds instead (set_weights hands them its state)."""
        served = {id(v) for layer in self._dynamic_layers() for v in layer.served_variables()}
        return [w for w in self.model.weights if id(w) not in served]

    def _dynamic_layers(self) -> list:
        return [layer for layer in keras_shim.layers_of(self.model) if isinstance(layer, dynamic_layer.LayerBody)]

    def call_on(self, net, inputs: Dict[str, object]) -> list:
        """The rebuilt model's outputs: a cloned graph network's own, a subclassed one called on
        `inputs` (placeholders by input name)."""
        if not self.subclassed:
            return list(net.outputs)
        called = net(inputs if self.input_names != ["x"] else inputs["x"])
        if isinstance(called, (list, tuple, dict)):
            raise ModelError("ptf.fit takes a subclassed model with one output; give a functional model for more")
        return [called]

    @contextlib.contextmanager
    def rebuild(self):
        """The model again, in the current (graph-mode) graph, each variable starting from the
        eager model's value (created on entering, or for a subclassed model while it is first
        called inside the block)."""
        import tf_keras
        matched: Dict[int, str] = {}

        def creator(next_creator, **kwargs):
            scope = tf.compat.v1.get_default_graph().get_name_scope()
            name = f"{scope}/{kwargs.get('name')}" if scope else kwargs.get("name")
            index = self._eager_weight_of(name, matched)
            if index is not None:
                kwargs["initial_value"] = self.weights[index][1]
                matched[index] = name
            return next_creator(**kwargs)
        if self.builder is not None:     # its layers and weights named as in the eager build
            keras_shim.continue_layer_names(self._name_counters)
        with tf.variable_creator_scope(creator):
            net = self.builder() if self.builder is not None else tf_keras.models.clone_model(self.model)
            yield net
        graph = tf.compat.v1.get_default_graph()
        for layer in self._dynamic_layers():       # the table starts from the eager layer's state
            dynamic_layer.bind(graph, layer.name, layer)
        self.graph_names = matched
        missing = [name for i, (name, _) in enumerate(self.weights) if i not in matched]
        if missing:
            raise ModelError(f"ptf.fit rebuilt the model without the weight(s) {missing[:3]} of the compiled one; "
                             "build one model per call of the function you give ptf.fit (its weights' names "
                             "must not depend on models built before it)")

    def _eager_weight_of(self, name: str, matched: Dict[int, str]) -> Optional[int]:
        """The first eager weight not matched yet that a variable `name` of the rebuilt model is:
        the same name, or the same name under the layer's scope (eager preprocessing layers name
        their weights without one: `mean`, `normalization/mean` in a graph)."""
        unmatched = [(index, eager) for index, (eager, _) in enumerate(self.weights) if index not in matched]
        return next((i for i, eager in unmatched if eager == name),
                    next((i for i, eager in unmatched if name.endswith("/" + eager)), None))

    def optimizer(self):
        """compile's optimizer as a fresh legacy tf_keras optimizer of the same class and settings
        (a new one per model_fn call: an optimizer belongs to one graph)."""
        made = self._optimizer
        if isinstance(made, tf.compat.v1.train.Optimizer):
            return made
        return _dividing_as_the_new_one(made.__class__.from_config(made.get_config()), self._converted)

    def per_output(self, what: str, default=None) -> Dict[str, object]:
        """compile's `what` (loss, loss_weights) as one value per output name."""
        value = self.compiled.get(what)
        value = default if value is None else value
        names = self.output_names
        if isinstance(value, dict):
            missing = [n for n in names if n not in value]
            if missing:
                raise ModelError(f"compile's {what} has no entry for output(s) {missing}")
            return {n: value[n] for n in names}
        if isinstance(value, (list, tuple)):
            if len(value) != len(names):
                raise ModelError(f"compile's {what} has {len(value)} entries for {len(names)} outputs")
            return dict(zip(names, value))
        return {n: value for n in names}

    def set_weights(self, values: Dict[str, object]) -> None:
        """The eager model's weights from trained values keyed by single-device names."""
        import tf_keras
        self.eager_classes()
        tf_keras.backend.batch_set_value(
            [(w, values[self.graph_names.get(i, name)]) for i, ((name, _), w) in enumerate(
                zip(self.weights, self._trained_weights()))])
        for layer in self._dynamic_layers():
            layer.take(values)

    def eager_classes(self) -> None:
        """The eager model's classes back on tf_keras' v2 bases. tf_keras picks a Model's and a
        Layer's base class (v1 graph or v2) when one is made, by rewriting the class's __bases__
        for every instance: the rebuild in the toolkit's graph left the eager model's classes
        on the v1 ones, whose evaluate, predict and save are the graph-mode ones."""
        keras_shim.classes_on_v2_bases(self.model)


def eagerly():
    """Eager execution inside the toolkit's graph (input_fn and hooks are called with it as the
    default): the script's own model and datasets live eagerly."""
    return tf_shim.eager_mode()


def _legacy_optimizer(chosen):
    """The legacy optimizer equivalent to compile's `optimizer` (read eagerly, as the new
    optimizers' settings can only be)."""
    import tf_keras
    if isinstance(chosen, str):
        return tf_keras.optimizers.get(chosen, use_legacy_optimizer=True)
    if isinstance(chosen, (tf_keras.optimizers.legacy.Optimizer, tf.compat.v1.train.Optimizer)):
        return chosen
    return keras_shim.to_legacy_optimizer(chosen)


def _dividing_as_the_new_one(optimizer, converted: bool):
    """The new RMSprop divides by sqrt(v + epsilon), its legacy twin without momentum by
    sqrt(v) + epsilon (2e-2 apart after 6 steps of small gradients). With its momentum given as
    a callable of zero the legacy one runs TF's fused RMSProp kernel, which divides as the new
    one does; Nadam's momentum schedule has no legacy equal."""
    import tf_keras
    if not converted:
        return optimizer
    if isinstance(optimizer, tf_keras.optimizers.legacy.Nadam):
        raise ConfigError("ptf.fit cannot train compile's new Keras Nadam exactly: its legacy twin, the only one a "
                          "tf.compat.v1 graph runs, schedules the momentum differently; compile with "
                          "tf_keras.optimizers.legacy.Nadam (single-device fit then uses it too) or 'adam'")
    config = optimizer.get_config()
    if isinstance(optimizer, tf_keras.optimizers.legacy.RMSprop) and not config.get("momentum"):
        return type(optimizer).from_config({**config, "momentum": _no_momentum})
    return optimizer


def _no_momentum() -> float:
    return 0.0


def weight_name(variable) -> str:
    return variable.name.split(":")[0]


def metric_list(chosen, output: str) -> List[object]:
    """compile's metrics (or weighted_metrics) for one output, as given."""
    chosen = chosen or []
    if isinstance(chosen, dict):
        chosen = chosen.get(output) or []
    return list(chosen) if isinstance(chosen, (list, tuple)) else [chosen]
