"""Where a model's fully connected head begins (Stanza's layer separation).

The head is everything the loss computes downstream of the first fully connected kernel: the
ops that descend from a read of any `fully_connected` weight. Its variables are those used only
there; the rest of the model (convolutions, pooling, embeddings: the feature extractor) is used
only before it. The cut is the set of tensors computed before the head and consumed inside it:
- "activation": computed from the feature extractor's weights, one row per example; the FC node
  returns its gradient;
- "data": an input the head reads (labels, weights), one row per example, carried as fed (what
  the head computes from it alone is recomputed on the FC node); forward only;
- "replicated": computed from the extractor's weights alone, not per example (a weight-decay
  term added to the loss): the same on every conv node, so one conv node sends it.
Tensors computed from neither (constants, reads of the head's own weights) are rebuilt on the
FC node. A model whose FC layers feed back into the extractor, whose weights are shared across
the cut, or whose cut carries a batch-wide value, has no clean cut: LayerCutError says which
op or variable is in the way.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List

import tensorflow as tf

from parallax_tf import graph_walk, training_record
from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.errors import ModelError
from rewriters.stanza.split import CutTensor

HEAD_KINDS = {"fully_connected", "bias", "norm", "other"}
ACTIVATION, DATA, REPLICATED = "activation", "data", "replicated"


class LayerCutError(ModelError):
    """The model has no clean cut between its feature extractor and its FC head."""


@dataclasses.dataclass
class HeadCut:
    variables: List[str]        # logical names of the head's trainable variables
    state: List[str]            # model state only the head updates (batch norm inside the head)
    cut: List[CutTensor]

    @property
    def bytes_per_example(self) -> int:
        return sum(t.bytes_per_example for t in self.cut if t.kind != REPLICATED)


def find_head(loss: tf.Tensor, parts: Dict[str, list], kinds: Dict[str, str], state: Dict[str, tf.Variable],
              train_op) -> HeadCut:
    """`parts`: logical name -> the variables holding it; `kinds`: logical name -> layer kind;
    `state`: the model's non-trainable variables by name."""
    forward = graph_walk.ancestors(loss.op, data_only=True)
    uses = {name: {op for v in variables for op in _uses(v) if op in forward} for name, variables in parts.items()}
    kernels = [name for name, kind in kinds.items() if kind == "fully_connected" and uses.get(name)]
    if not kernels:
        raise LayerCutError("the model has no fully connected layer on the way to the loss, so there is no FC "
                            "head to put on FC nodes; use --strategy hybrid")
    head_ops = graph_walk.descendants({op for name in kernels for op in uses[name]}, within=forward)
    head_vars, extractor_vars = [], []
    for name in sorted(parts):
        inside = uses[name] & head_ops
        if uses[name] and inside == uses[name]:
            head_vars.append(name)
        elif inside:
            raise LayerCutError(f"variable {name!r} is used both inside the FC head (by {sorted(op.name for op in inside)[0]!r}) "
                                f"and before it: no clean cut between the layers; use --strategy hybrid")
        elif uses[name]:
            extractor_vars.append(name)
    wrong = [n for n in head_vars if kinds[n] not in HEAD_KINDS]
    if wrong:
        raise LayerCutError(f"the {kinds[wrong[0]]} layer {wrong[0]!r} comes after a fully connected layer: the "
                            "FC layers are interleaved with the rest of the model, so there is no clean cut; "
                            "use --strategy hybrid")
    if not extractor_vars:
        raise LayerCutError("every trained layer is in the FC head (the model is fully connected from its input "
                            "on): conv nodes would have nothing to train; use --strategy hybrid")
    storage = {training_record.storage(v).name for name in head_vars for v in parts[name]}
    extractor_storage = {training_record.storage(v).name for name in extractor_vars for v in parts[name]}
    cut = _cut_tensors(head_ops, forward, extractor_storage, storage)
    if not any(t.kind == ACTIVATION for t in cut):
        raise LayerCutError("no activation crosses from the feature extractor into the FC head; the layers "
                            "do not form a chain; use --strategy hybrid")
    head_state = sorted(name for name, var in state.items() if _written_inside(var, head_ops, train_op))
    return HeadCut(variables=head_vars, state=head_state, cut=cut)


def _uses(variable) -> set:
    """Ops that read the variable's value (through its read ops)."""
    return set(graph_walk.users(training_record.storage(variable), graph_walk.VALUE_READ_OPS))


def _cut_tensors(head_ops: set, forward: set, extractor_storage: set, head_storage: set) -> List[CutTensor]:
    found: Dict[str, CutTensor] = {}
    for op in sorted(head_ops, key=tf_shim.creation_order):
        for tensor in op.inputs:
            if tensor.op in head_ops or tensor.name in found or tensor.dtype == tf.resource:
                continue
            kind = _kind(tensor, extractor_storage, head_storage)
            if kind == DATA:            # the inputs it is computed from, which every other use reads too
                for source in _fed_sources(tensor):
                    if source.name not in found:
                        found[source.name] = _describe(source, DATA, op)
            elif kind is not None:
                found[tensor.name] = _describe(tensor, kind, op)
    return list(found.values())


def _fed_sources(tensor) -> list:
    """The fed inputs (labels, weights) a tensor computed from the input alone derives from: the
    FC node receives those and recomputes the rest, so that every op reading them there (a loss,
    a metric's update) reads what arrived."""
    if tensor.op.type in graph_walk.FED_INPUT_OPS:
        return [tensor]
    ops = graph_walk.ancestors(tensor.op, data_only=True) | {tensor.op}
    sources = {t.name: t for op in ops for t in op.inputs if t.op.type in graph_walk.FED_INPUT_OPS}
    return [sources[name] for name in sorted(sources)]


def _kind(tensor, extractor_storage: set, head_storage: set):
    """activation / data / replicated, or None when the FC node can rebuild it itself."""
    deps = graph_walk.ancestors(tensor.op, data_only=True)
    from_extractor = any(t.name in extractor_storage for op in deps for t in op.outputs)
    from_input = any(op.type in graph_walk.INPUT_OPS for op in deps)
    if not from_extractor and not from_input:
        return None
    per_example = tensor.shape.rank is not None and tensor.shape.rank >= 1
    if from_extractor and not from_input:
        return REPLICATED
    if not per_example:
        return "batch_wide"
    return ACTIVATION if from_extractor and tensor.dtype.is_floating else DATA


def _describe(tensor, kind: str, consumer) -> CutTensor:
    if kind == "batch_wide":
        raise LayerCutError(f"tensor {tensor.name!r} (consumed by {consumer.name!r} in the FC head) is computed from "
                            "the whole batch but has no batch dimension: the FC node cannot rebuild it from the conv "
                            "nodes' pieces; compute it inside the head or use --strategy hybrid")
    dims = tensor.shape.as_list() if tensor.shape.rank is not None else []
    if kind != REPLICATED and dims and dims[0] is not None:
        raise LayerCutError(f"tensor {tensor.name!r} entering the FC head has a fixed batch dimension ({dims[0]}): "
                            "the FC node concatenates the conv nodes' batches, so build the input placeholders "
                            "with a None batch dimension")
    per = dims[1:] if kind != REPLICATED else dims
    if any(d is None for d in per):
        raise LayerCutError(f"tensor {tensor.name!r} entering the FC head has an unknown shape {dims}; give it a "
                            "static shape per example (e.g. a reshape to [-1, features]) before the first FC layer")
    count = 1
    for d in per:
        count *= d
    return CutTensor(name=tensor.name, shape=per, dtype=tensor.dtype.name, bytes_per_example=count * tensor.dtype.size,
                     kind=kind)


def _written_inside(variable, head_ops: set, train_op) -> bool:
    """Whether the train op updates this state from values the head computes."""
    target = training_record.storage(variable).name
    for op in graph_walk.ancestors(train_op):
        if op.type.startswith(("Assign", "ResourceScatter", "Scatter")) and op.inputs and op.inputs[0].name == target:
            if graph_walk.ancestors(op, data_only=True) & head_ops:
                return True
    return False
