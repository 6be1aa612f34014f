"""Tracing a TF2 training step once, recording how it trains.

The step (a tf.function or a plain Python function) is traced into a graph for the dataset's
element, as tf.function traces it for its first call. While it is traced, every
`tf.GradientTape.gradient` call and every optimizer apply (Keras 3's `apply` /
`apply_gradients`, tf_keras' new and legacy `apply_gradients`, tf.compat.v1.train's) is
recorded with the graph ops it made, so the toolkit knows which variables the step
differentiates, from which loss, and which ops update them from which gradients. The patches
hold for the trace only and are restored on exit, error or not."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Dict, List, Optional

import tensorflow as tf

from parallax_tf.dynamic import layer as dynamic_layer
from parallax_tf.errors import ModelError


@dataclasses.dataclass
class TapeCall:
    """One GradientTape.gradient(target, sources) of the traced step."""
    targets: list                  # the target's tensors (a scalar loss, usually)
    output_gradients: Optional[list]
    sources: list                  # tf.Variables, in the order given
    grads: list                    # per source: a tensor, an IndexedSlices or None


@dataclasses.dataclass
class OptimizerCall:
    """One optimizer apply of the traced step: its gradients and the ops it made."""
    optimizer: object
    grads_and_vars: list           # (gradient, tf.Variable) as the step passed them
    ops: List[tf.Operation]        # what the apply made, in order


@dataclasses.dataclass
class Trace:
    """The step as one graph (a FuncGraph) and what it recorded."""
    graph: object
    inputs: List[tf.Tensor]        # the graph's placeholders for the element's flat tensors
    outputs: Dict[str, tf.Tensor]  # "loss" and the metrics the step returns beside it
    tape_calls: List[TapeCall]
    optimizer_calls: List[OptimizerCall]
    dynamic_lookups: List[dynamic_layer.TracedLookup] = dataclasses.field(default_factory=list)


def _optimizer_entry_points():
    """(class, method name) of every optimizer apply a step may call, for the libraries installed."""
    found = [(tf.compat.v1.train.Optimizer, "apply_gradients")]
    try:
        import keras
        found.append((keras.optimizers.Optimizer, "apply"))
    except ImportError:
        pass
    try:
        import tf_keras
        found += [(tf_keras.optimizers.Optimizer, "apply_gradients"),
                  (tf_keras.optimizers.legacy.Optimizer, "apply_gradients")]
    except ImportError:
        pass
    return found


class _Recorder:
    def __init__(self):
        self.tape_calls: Dict[object, List[TapeCall]] = {}        # FuncGraph -> its calls
        self.optimizer_calls: Dict[object, List[OptimizerCall]] = {}
        self.applying = 0

    @contextlib.contextmanager
    def recording(self):
        saved = [(tf.GradientTape, "gradient", vars(tf.GradientTape)["gradient"])]
        saved += [(owner, name, owner.__dict__.get(name)) for owner, name in _optimizer_entry_points()]
        tf.GradientTape.gradient = self._recorded_gradient(saved[0][2])
        for owner, name, _ in saved[1:]:
            setattr(owner, name, self._recorded_apply(getattr(owner, name), name))
        try:
            yield self
        finally:
            for owner, name, original in saved:
                if original is None:
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)

    def _recorded_gradient(self, gradient):
        recorder = self

        @functools.wraps(gradient)
        def recorded(tape, target, sources, output_gradients=None, *args, **kwargs):
            grads = gradient(tape, target, sources, output_gradients, *args, **kwargs)
            graph = tf.compat.v1.get_default_graph()
            flat_sources = tf.nest.flatten(sources)
            flat_grads = tf.nest.flatten(grads, expand_composites=False)
            if len(flat_grads) == len(flat_sources):
                recorder.tape_calls.setdefault(graph, []).append(TapeCall(
                    tf.nest.flatten(target), None if output_gradients is None else tf.nest.flatten(output_gradients),
                    flat_sources, flat_grads))
            return grads
        return recorded

    def _recorded_apply(self, apply, name: str):
        recorder = self

        @functools.wraps(apply)
        def recorded(optimizer, *args, **kwargs):
            if recorder.applying:          # an optimizer's apply calling another (a wrapper's)
                return apply(optimizer, *args, **kwargs)
            graph = tf.compat.v1.get_default_graph()
            before = len(graph.get_operations())
            args, kwargs = _materialized(name, args, kwargs)     # a zip is read once: by the record and by apply
            pairs = _grads_and_vars(name, args, kwargs)
            recorder.applying += 1
            try:
                result = apply(optimizer, *args, **kwargs)
            finally:
                recorder.applying -= 1
            made = graph.get_operations()[before:]
            recorder.optimizer_calls.setdefault(graph, []).append(OptimizerCall(optimizer, pairs, made))
            return result
        return recorded


def _materialized(name: str, args, kwargs):
    """The apply's arguments with its gradients (an iterator, often a zip) made into lists."""
    key = {"apply": "grads"}.get(name, "grads_and_vars")
    if args:
        return (list(args[0]),) + tuple(args[1:]), kwargs
    if key in kwargs:
        return args, dict(kwargs, **{key: list(kwargs[key])})
    return args, kwargs


def _grads_and_vars(name: str, args, kwargs) -> list:
    """The (gradient, variable) pairs of an apply call: apply_gradients(pairs) or Keras 3's
    apply(grads, variables)."""
    if name == "apply":
        grads = args[0] if args else kwargs.get("grads")
        variables = args[1] if len(args) > 1 else kwargs.get("trainable_variables")
        return list(zip(grads, variables)) if variables is not None else [(g, None) for g in grads]
    pairs = args[0] if args else kwargs.get("grads_and_vars")
    return list(pairs)


def _signature(element_spec):
    """The element's spec with every batch dimension left open: ranks get unequal shares."""
    def relaxed(spec):
        if not isinstance(spec, tf.TensorSpec) or spec.shape.rank is None or spec.shape.rank == 0:
            return spec
        return tf.TensorSpec([None] + spec.shape.as_list()[1:], spec.dtype)
    return tf.nest.map_structure(relaxed, element_spec)


def call_signature(element_spec):
    """(positional specs, keyword specs) the step is called with for one element: a tuple's items
    as positional arguments, anything else (a dict, a tensor) as the one argument."""
    spec = _signature(element_spec)
    return (tuple(spec), {}) if isinstance(spec, tuple) else ((spec,), {})


def trace(step, element_spec) -> Trace:
    """Traces `step` for `element_spec`'s elements. A tf.function is traced afresh from its
    Python function, so that an earlier call's cached trace does not hide what it records."""
    python_function = getattr(step, "python_function", None)
    fresh = tf.function(python_function) if python_function is not None else tf.function(step)
    args, kwargs = call_signature(element_spec)
    recorder = _Recorder()
    with recorder.recording(), dynamic_layer.tracing() as lookups:
        concrete = fresh.get_concrete_function(*args, **kwargs)
    graph = concrete.graph
    structured = concrete.structured_outputs
    outputs = _named_outputs(structured)
    tapes = recorder.tape_calls.get(graph, [])
    if not tapes:
        raise ModelError("the training step computed no gradient: compute them with tf.GradientTape "
                         "(`grads = tape.gradient(loss, model.trainable_variables)`) inside the step")
    captured_inputs = len(graph.inputs) - len(graph.captures)
    return Trace(graph, list(graph.inputs[:captured_inputs]), outputs, tapes,
                 recorder.optimizer_calls.get(graph, []), [look for look in lookups if look.rows.graph is graph])


def _named_outputs(structured) -> Dict[str, tf.Tensor]:
    """{"loss": the loss, name: each metric} of what the step returns: the loss alone, or a dict
    holding "loss" and metrics (scalars) beside it."""
    if isinstance(structured, dict):
        if "loss" not in structured:
            raise ModelError(f"the training step returned a dict without a 'loss' (keys {sorted(structured)}); "
                             "return the loss, or {'loss': loss, 'name': metric, ...}")
        found = dict(structured)
    elif isinstance(structured, (list, tuple)) and structured:
        found = {"loss": structured[0]}
    else:
        found = {"loss": structured}
    for name, value in found.items():
        if not isinstance(value, tf.Tensor) or value.shape.rank != 0 or not (value.dtype.is_floating
                                                                              or value.dtype.is_integer):
            what = "nothing" if value is None else f"{type(value).__name__} {getattr(value, 'shape', '')}"
            raise ModelError(f"the training step returned {what} as {name!r}; return a scalar loss tensor "
                             "(e.g. tf.reduce_mean of the batch's losses), or {'loss': loss, ...}")
    return found
