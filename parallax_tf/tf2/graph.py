"""A traced TF2 step as the toolkit's training record, in the current (tf.compat.v1) graph.

The trace's graph is imported into the graph being built (inspection's, or a rank's rewrite),
with its inputs fed by placeholders and every variable it captured replaced by one made here
through the rewriter's variable hook, so the plan places it as it places a model_fn's
variables (variables.py; a table the plan splits into row shards as split.py splits it). What
the trace recorded becomes the same `training_record.Training` a model_fn's build records: the
tape's target as the loss its gradients come from, the tape's gradients as the raw gradients,
each optimizer apply's ops (or, for a hand-written update, the ops between a gradient and its
variable's write) as an apply, and the variables an apply writes next to one trainable
variable, of its shape, as that variable's slots.

Each rank's share of a global batch may be uneven (a short last batch): the loss's gradient is
taken with its share as `grad_ys` (rows here x data ranks / rows in the global batch), and the
reported loss and metrics are scaled by it, so the mean over ranks is the single-device figure
of a loss that is a mean over the batch's examples."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf

from parallax_tf import graph_walk, input_shard
from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.compat import tf_keras as keras_shim
from parallax_tf.errors import ModelError
from parallax_tf.model import Model, RunContext, check_metrics
from parallax_tf.tf2 import split, variables
from parallax_tf.tf2.fixed import fixed_reads
from parallax_tf.tf2.naming import VariableNames
from parallax_tf.tf2.rows import components, data_sources, read_rows_only, rows_each
from parallax_tf.tf2.trace import Trace
from parallax_tf.training_record import Apply, GradientCall, Training

SHARE = "parallax_tf2_share"        # placeholder: this rank's share of the global batch's mean
IMPORTED = "step"                   # the name scope the trace's ops are imported under


@dataclasses.dataclass
class _Captured:
    """What the traced graph captured from outside: variables (by the placeholder standing for
    each) and other eager values (constants)."""
    variables: Dict[str, tf.Variable]      # internal placeholder op name -> the eager variable
    constants: Dict[str, np.ndarray]


def captured(trace: Trace) -> _Captured:
    # the graph lists the variables it reads; an optimizer's slots made while it was first
    # traced are only the optimizer's
    known = list(trace.graph.variables) + [v for call in trace.optimizer_calls for v in _held(call.optimizer)]
    by_handle = {id(v.handle): v for v in known}
    variables, constants = {}, {}
    for external, internal in trace.graph.captures:
        variable = by_handle.get(id(external))
        if variable is not None:
            variables[internal.op.name] = variable
        elif external.dtype == tf.resource:
            raise ModelError(f"the training step uses a resource that is not a variable ({internal.op.name}: a lookup "
                             "table, an iterator, ...); build it inside the step or read the dataset's element instead")
        else:
            constants[internal.op.name] = external.numpy()
    return _Captured(variables, constants)


def input_names(trace: Trace, element_spec) -> List[str]:
    """The placeholder name of each of the element's flat tensors: its path in the element."""
    paths = [p for p, _ in _flatten_with_paths(element_spec)]
    if len(paths) != len(trace.inputs):
        raise ModelError(f"the training step takes {len(trace.inputs)} tensor(s), the dataset's element holds "
                         f"{len(paths)}; the step is called with a tuple element's items as its arguments, or with "
                         "a dict element as its one argument")
    return ["input_" + "_".join(str(part) for part in path) if path else "input" for path in paths]


def _flatten_with_paths(structure, path=()):
    if isinstance(structure, dict):
        return [item for key in sorted(structure) for item in _flatten_with_paths(structure[key], path + (key,))]
    if isinstance(structure, (tuple, list)):
        return [item for i, value in enumerate(structure) for item in _flatten_with_paths(value, path + (i,))]
    return [(path, structure)]


class _Writes:
    """The traced graph's variable writes, by the variable they write."""

    def __init__(self, trace: Trace, variables: Dict[str, tf.Variable]):
        self.by_variable: Dict[int, List[tf.Operation]] = {}
        for op in trace.graph.get_operations():
            if not _writes(op) or not op.inputs:
                continue
            # a fused apply kernel writes its variable and every slot it is handed
            written = [t for t in op.inputs if t.dtype == tf.resource] if op.type.startswith(
                ("ResourceApply", "ResourceSparseApply")) else [op.inputs[0]]
            for handle in written:
                source = graph_walk.feeding_op(handle, graph_walk.HANDLE_PASS_THROUGH_OPS)
                variable = variables.get(source.name)
                if variable is not None:
                    self.by_variable.setdefault(id(variable), []).append(op)

    def of(self, variable) -> List[tf.Operation]:
        return self.by_variable.get(id(variable), [])


def _writes(op) -> bool:
    return op.type in graph_walk.WRITE_OPS or op.type.startswith(("ResourceApply", "ResourceSparseApply"))


@dataclasses.dataclass
class _Update:
    """One apply of the traced step, in the trace's own ops."""
    optimizer: object                 # None: a hand-written update
    pairs: list                       # (gradient in the trace, eager variable)
    ops: List[tf.Operation]           # what it made (the optimizer's ops, or the write's own chain)
    counter: Optional[tf.Variable] = None


def updates(trace: Trace, found: _Captured, writes: _Writes) -> List[_Update]:
    """Every apply of the step: the recorded optimizer calls, and for each trainable variable that
    is written but by none of them, a hand-written update from its tape gradient."""
    found_updates, applied = [], set()
    for call in trace.optimizer_calls:
        pairs = [(g, v) for g, v in call.grads_and_vars if g is not None and v is not None]
        variables = [_tf_variable(v) for _, v in pairs]
        found_updates.append(_Update(call.optimizer, [(g, v) for (g, _), v in zip(pairs, variables)], list(call.ops),
                                     _counter(call.optimizer)))
        applied.update(id(v) for v in variables)
    raw = _tape_gradients(trace)
    for variable_id, (grad, variable) in raw.items():
        if variable_id in applied or not writes.of(variable):
            continue
        grad_ops = {t.op for t in components(grad)}
        chain = set()
        for write in writes.of(variable):
            above = graph_walk.ancestors(write) | {write}
            chain |= {op for op in above if op in graph_walk.descendants(grad_ops) or op is write}
        found_updates.append(_Update(None, [(grad, variable)], sorted(chain, key=lambda op: op.name)))
    return found_updates


def _tf_variable(variable):
    """The tf.Variable behind a Keras 3 variable (its `value`), or the variable itself."""
    inner = getattr(variable, "value", None)
    return inner if isinstance(inner, tf.Variable) and not isinstance(variable, tf.Variable) else variable


def _counter(optimizer) -> Optional[tf.Variable]:
    iterations = getattr(optimizer, "iterations", None)
    return _tf_variable(iterations) if iterations is not None else None


def _tape_gradients(trace: Trace) -> Dict[int, tuple]:
    """id(variable) -> (its gradient in the trace, the variable), from the tape calls."""
    found = {}
    for call in trace.tape_calls:
        for source, grad in zip(call.sources, call.grads):
            variable = _tf_variable(source)
            if grad is not None and isinstance(variable, tf.Variable):
                found[id(variable)] = (grad, variable)
    return found


def slots(trace_updates: List[_Update], writes: _Writes, found: _Captured) -> Dict[int, tf.Variable]:
    """id(slot variable) -> the trainable variable it belongs to: a non-trainable variable an
    apply writes from one variable's gradient alone, of that variable's shape."""
    owners = {}
    for update in trace_updates:
        if update.optimizer is None:
            continue
        made = set(update.ops)
        for variable in found.variables.values():
            if variable.trainable or not any(w in made for w in writes.of(variable)):
                continue
            reached = [v for g, v in update.pairs
                       if any(_reaches(g, w) for w in writes.of(variable) if w in made)]
            if len(reached) == 1 and reached[0].shape == variable.shape:
                owners[id(variable)] = reached[0]
    return owners


def _reaches(grad, op) -> bool:
    sources = data_sources(op)
    return any(t.name in sources for t in components(grad))


def untie_identity_n(graph_def) -> None:
    """An IdentityN over every gradient (Keras 3's sum over the default strategy's one replica)
    ties each gradient to all the others in a walk of the graph: its consumers read its inputs
    instead, each the one gradient it passes on."""
    passes = {node.name: list(node.input) for node in graph_def.node if node.op == "IdentityN"}
    for node in graph_def.node:
        for i, name in enumerate(node.input):
            source, _, index = name.partition(":")
            if source in passes and not name.startswith("^"):
                node.input[i] = passes[source][int(index or 0)]


class Converter:
    """The trace, ready to be imported into a graph as many times as the toolkit builds one."""

    def __init__(self, trace: Trace, element_spec, names: VariableNames):
        self.trace = trace
        self.found = captured(trace)
        self.writes = _Writes(trace, self.found.variables)
        self.updates = updates(trace, self.found, self.writes)
        if not any(self.writes.of(v) for u in self.updates for _, v in u.pairs):
            raise ModelError("the training step updates no variable from its gradients: apply them inside the step "
                             "(optimizer.apply_gradients(zip(grads, variables)), or variable.assign_sub(lr * grad))")
        self.slot_owner = slots(self.updates, self.writes, self.found)
        self.rows_each = rows_each(self.updates)
        self.tape_grads = {i: g for i, (g, v) in _tape_gradients(trace).items() if v.trainable}
        self.inputs = input_names(trace, element_spec)
        self.names = names
        self.graph_def = trace.graph.as_graph_def()
        for node in self.graph_def.node:     # where ops run is the plan's and the runtime's to say
            node.device = ""
            node.attr.pop("_class", None)
        untie_identity_n(self.graph_def)
        read_rows_only(self.graph_def, set(self.found.variables))
        # the values the step starts from, read eagerly once (a build runs in graph mode)
        self.values = {id(v): v.numpy() for v in self.found.variables.values()}
        hyper = {id(_tf_variable(v)) for u in self.updates if u.optimizer is not None
                 for v in _held(u.optimizer) + keras_shim.hyper_parameter_variables(u.optimizer)}
        self.fixed_reads = fixed_reads(trace.graph, self.found.variables, hyper)

    def build(self, ctx: RunContext, variable_hook=None, row_splits: Optional[Dict[str, List[int]]] = None) -> Training:
        """The step in the current default graph: its variables made through `variable_hook`
        (next_creator, kwargs, in_apply), as a model_fn's are, each variable named in
        `row_splits` as shards of those rows (tf2/split.py), and its training record."""
        made = variables.make(self.found.variables.values(), self.slot_owner, self.names, self.values,
                              variable_hook, ctx, row_splits or {})
        placeholders = {name: tf.compat.v1.placeholder(t.dtype, t.shape, name=name)
                        for name, t in zip(self.inputs, self.trace.inputs)}
        share = tf.compat.v1.placeholder_with_default(tf.constant(1.0), [], name=SHARE)
        input_map = {f"{t.op.name}:0": placeholders[name] for name, t in zip(self.inputs, self.trace.inputs)}
        input_map.update({f"{op}:0": variables.handle(made[id(v)]) for op, v in self.found.variables.items()})
        input_map.update({f"{op}:0": tf.constant(value) for op, value in self.found.constants.items()})
        if ctx.rank == 0:       # the one graph with the servers' applies; see fixed.py
            input_map.update({read: tf.constant(self.values[id(v)]) for read, v in self.fixed_reads.items()})
        tf.compat.v1.import_graph_def(self.graph_def, input_map=input_map, name=IMPORTED)
        graph = tf.compat.v1.get_default_graph()
        self._dynamic_lookups(graph)
        splits, replaced = {}, {}
        for variable_id, shards in made.items():
            if isinstance(shards, split.Shards) and variable_id in self.tape_grads:
                grad = _imported_gradient(graph, self.tape_grads[variable_id])
                splits[variable_id] = (grad, shards.rows_of(grad))
                replaced.update(split.apply_split(shards, grad, splits[variable_id][1]))
        split.reorder(graph, replaced)
        return self._record(made, share, ctx, splits, replaced)

    def _dynamic_lookups(self, graph) -> None:
        """Each dynamic layer's stand-in rows become a lookup of its table in this graph."""
        for traced in self.trace.dynamic_lookups:
            rows = traced.layer.graph_table().lookup(_imported(graph, traced.ids))
            tf_shim.replace_uses(_imported(graph, traced.rows), rows)

    def _record(self, made: Dict[int, object], share, ctx, splits: Dict[int, tuple], replaced: dict) -> Training:
        graph = tf.compat.v1.get_default_graph()

        def here(tensor):
            return _imported(graph, tensor)

        def here_op(op):
            return graph.get_operation_by_name(f"{IMPORTED}/{op.name}")

        def run_instead(ops):       # an op of the trace, or what replaces it in this graph
            return [new for op in ops for new in replaced.get(here_op(op), [here_op(op)])]

        def per_variable(variable, grad) -> list:
            """(variable, gradient) pairs of a captured variable: one per shard when it is split."""
            if id(variable) in splits:
                return list(zip(made[id(variable)].parts, splits[id(variable)][1]))
            return [(made[id(variable)], _imported_gradient(graph, grad))]

        calls = []
        for call in self.trace.tape_calls:
            kept = [pair for s, g in zip(call.sources, call.grads) if g is not None and id(_tf_variable(s)) in made
                    for pair in per_variable(_tf_variable(s), g)]
            targets = [here(_without_control_identity(t)) for t in call.targets]
            grad_ys = [share * tf.ones_like(t) for t in targets] if call.output_gradients is None else \
                [share * here(t) for t in call.output_gradients]
            calls.append(GradientCall(targets, grad_ys, [v for v, _ in kept], [g for _, g in kept]))
        applies = [self._apply(update, made, per_variable, run_instead) for update in self.updates]
        outputs = {name: here(_without_control_identity(t)) for name, t in self.trace.outputs.items()}
        loss = tf.cast(outputs.pop("loss"), tf.float32) * share
        metrics = {name: tf.cast(value, tf.float32) * share for name, value in outputs.items()}
        check_metrics(metrics)
        stateful = run_instead(self.trace.graph.control_outputs)
        train_op = tf.group(*stateful, *[a.op for a in applies])
        model = Model(loss=loss, train_op=train_op, metrics=metrics or None)
        # An optimizer's own counter stays its own (every rank advances its copy, as every rank
        # reads it in its updates); the toolkit counts the job's steps with a step of its own.
        return Training(model=model, loss=loss, train_op=train_op, applies=applies, gradient_calls=calls,
                        global_step=None, keras_layers={},
                        inputs=input_shard.Scope(ctx, False),
                        rows_each={made[i].op.name for i in self.rows_each if isinstance(made.get(i), tf.Variable)},
                        split_refusals=self._split_refusals(graph, made),
                        row_targets=[(c.ys, c.grad_ys) for c in calls])

    def _apply(self, update: _Update, made: Dict[int, object], per_variable, run_instead) -> Apply:
        """One update of the trace as the record's Apply: what it writes, its slots (per shard
        of a split variable), the ops it made (the optimizer's, not the model's)."""
        created = {op.name for op in run_instead(update.ops)} | {f"{IMPORTED}/{op.name}" for op in update.ops}
        slots: Dict[str, Dict[str, tf.Variable]] = {}
        made_ops, its_own = set(update.ops), _optimizer_variables(update.optimizer)
        for variable in self.found.variables.values():
            owner = self.slot_owner.get(id(variable))
            pieces = variables.pieces(made[id(variable)])
            if not variable.trainable and (id(variable) in its_own or
                                           any(w in made_ops for w in self.writes.of(variable))):
                created.update(p.op.name for p in pieces)     # the optimizer's state, not the model's
            if owner is not None and any(owner is v for _, v in update.pairs):
                for slot, part in zip(pieces, variables.pieces(made[id(owner)])):
                    created.add(slot.op.name)
                    slots.setdefault(part.op.name, {})[slot.op.name.rsplit("/", 1)[-1]] = slot
        writes = run_instead([op for op in update.ops if _writes(op)])
        pairs = [(g, v) for grad, variable in update.pairs for v, g in per_variable(variable, grad)]
        counter = made.get(id(update.counter)) if update.counter is not None else None
        return Apply(TracedOptimizer(update.optimizer, slots, made), pairs, None, tf.group(*writes), created, counter)

    def _split_refusals(self, graph, made: Dict[int, object]) -> Dict[str, str]:
        """Trainable variable op name -> why it cannot be split into row shards (split.refusal)."""
        refusals = {}
        for variable_id, grad in self.tape_grads.items():
            variable = made.get(variable_id)
            if not isinstance(variable, tf.Variable):
                continue
            slot_handles = [made[i].handle for i, owner in self.slot_owner.items()
                            if id(owner) == variable_id and isinstance(made.get(i), tf.Variable)]
            reason = split.refusal(variable.handle, slot_handles, _imported_gradient(graph, grad), IMPORTED)
            if reason:
                refusals[variable.op.name] = reason
        return refusals


def _imported(graph, tensor) -> tf.Tensor:
    return graph.get_tensor_by_name(f"{IMPORTED}/{tensor.name}")


def _imported_gradient(graph, grad):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(_imported(graph, grad.values), _imported(graph, grad.indices),
                                _imported(graph, grad.dense_shape) if grad.dense_shape is not None else None)
    return _imported(graph, grad)


def _held(optimizer) -> list:
    """The tf.Variables an optimizer holds (its learning rate, counter, slots)."""
    held = getattr(optimizer, "variables", None) if optimizer is not None else None
    held = held() if callable(held) else (held or [])
    return [v for v in map(_tf_variable, held) if isinstance(v, tf.Variable)]


def _optimizer_variables(optimizer) -> set:
    return {id(v) for v in _held(optimizer)}


class TracedOptimizer:
    """An apply of the traced step as the later stages ask an optimizer about it: its slots
    (tf.compat.v1.train.Optimizer's get_slot_names / get_slot) and what the step used."""

    def __init__(self, used, slots: Dict[str, Dict[str, tf.Variable]], made: Optional[Dict[int, object]] = None):
        self.used = used                  # the step's optimizer, or None for a hand-written update
        self.slots = slots               # variable op name -> slot name -> slot variable
        self._made = made or {}           # id(the script's variable) -> this graph's

    def in_graph(self, variable):
        """This graph's variable for one of the script's (a Keras 3 variable's too), or None."""
        found = self._made.get(id(_tf_variable(variable)))
        return found if isinstance(found, tf.Variable) else None

    @property
    def name(self) -> str:
        return type(self.used).__name__ if self.used is not None else "a hand-written update"

    def get_slot_names(self) -> List[str]:
        return sorted({name for slots in self.slots.values() for name in slots})

    def get_slot(self, variable, name: str):
        return self.slots.get(variable.op.name, {}).get(name)


def _without_control_identity(tensor):
    """A traced output without the Identity that makes it wait for the step's stateful ops."""
    while tensor.op.type == "Identity" and tensor.op.control_inputs:
        tensor = tensor.op.inputs[0]
    return tensor
