"""A TF2 step's table split into the plan's row shards.

A model_fn's table is split by get_variable's partitioner, and TF's lookups and optimizers then
work shard by shard. A traced step was written for one whole variable, so the split is made in
its imported graph: the variable becomes the plan's shards (id i in shard i mod N, as a "mod"
partitioned lookup reads them: a table's frequent ids, often its first, spread over the
servers), each of its slots likewise, and
- a lookup (ResourceGather) becomes a partitioned lookup over the shards;
- a read of its shape (VariableShape: a Keras 3 lookup clamps its ids by it), a constant;
- each update from its sparse gradient (a fused sparse apply, a scatter) is made once per
  shard, with the ops between the gradient and it, on the shard's rows of the gradient (their
  ids made the shard's own) and the shard's variable and slots.
A table the step uses in any other way, or whose update does more with the gradient's rows than
keep them apart (sums per id, scaling), stays whole: `refusal` says why, and the plan says it."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence

import tensorflow as tf

from parallax_tf import graph_walk
from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.tf2.rows import components

# Ops that keep a sparse gradient's rows apart on the way to its update: made once per shard on
# the shard's rows, they compute that shard's rows of what the whole made.
_ROW_WISE = frozenset({"Identity", "Unique", "Shape", "StridedSlice", "UnsortedSegmentSum", "Cast", "Reshape",
                       "Mul", "RealDiv", "Div", "Neg", "Square", "Sqrt", "AddV2", "Add", "Sub", "ExpandDims",
                       "Squeeze", "ResourceGather", "Const"})
_SCATTERS = frozenset({"ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterUpdate", "ResourceScatterMul",
                       "ResourceScatterDiv", "ResourceScatterMin", "ResourceScatterMax"})


def _writes_rows(op) -> bool:
    return op.type in _SCATTERS or op.type.startswith("ResourceSparseApply")


def refusal(handle: tf.Tensor, slot_handles: Sequence[tf.Tensor], grad, scope: str) -> str:
    """Why the variable behind `handle` cannot be split in this graph ("" when it can): its
    gradient `grad`, its slots' handles; the step's ops are those named under `scope`."""
    if not isinstance(grad, tf.IndexedSlices):
        return "its gradient is dense"
    for op in handle.consumers():
        if not op.name.startswith(scope + "/"):
            continue        # the variable's own (its initialiser, its initialised check)
        if not (_reads_rows(op) or (_writes_rows(op) and op.inputs[0] is handle)):
            return f"the step reads or writes it whole ({op.type} {op.name})"
    writes = row_writes([handle, *slot_handles], scope)
    if not any(op.inputs[0] is handle for op in writes):
        return "nothing in the step updates its rows"
    updates = update_ops(writes, grad)
    for write in writes:
        if not ({t.op for t in write.inputs} & (updates | {t.op for t in components(grad)})):
            return f"its update {write.name} does not read its gradient"
    for op in updates - set(writes):
        if op.type not in _ROW_WISE:
            return f"its update combines the gradient's rows ({op.type} {op.name})"
        if any(c not in updates for t in op.outputs for c in t.consumers()):
            return f"its update's op {op.name} is read elsewhere in the step"
    for slot in slot_handles:
        for op in slot.consumers():
            if op.name.startswith(scope + "/") and op not in updates and not _dead_read(op):
                return f"its optimizer uses slot {slot.op.name} whole ({op.type} {op.name})"
    return ""


def _reads_rows(op) -> bool:
    """A use of a table that does not need it whole: a lookup, its shape, a read nothing uses."""
    return (op.type == "ResourceGather" and op.get_attr("batch_dims") == 0) or op.type == "VariableShape" \
        or _dead_read(op)


def _dead_read(op) -> bool:
    return op.type == "ReadVariableOp" and not op.outputs[0].consumers()


def row_writes(handles: Sequence[tf.Tensor], scope: str) -> List[tf.Operation]:
    """The row updates (sparse applies, scatters) of the variables behind `handles` (in the step:
    the ops named under `scope`, if given)."""
    return sorted({op for h in handles for op in h.consumers()
                   if _writes_rows(op) and op.inputs[0] is h and (not scope or op.name.startswith(scope + "/"))},
                  key=tf_shim.creation_order)


def update_ops(writes: Sequence[tf.Operation], grad: tf.IndexedSlices) -> set:
    """`writes` and the ops between the gradient's tensors and them."""
    sources = {t.op for t in components(grad)}
    above = set().union(*(graph_walk.ancestors(w, data_only=True, stop=sources) for w in writes))
    return ((graph_walk.descendants(sources) & above) - sources) | set(writes)


@dataclasses.dataclass
class Shards:
    """A split variable in a rank's graph: its shards (id i in shard i mod N, as row i // N),
    its slots' shards by the slot's stand-in, and the stand-in the imported step's ops read for
    the whole variable."""
    parts: List[tf.Variable]
    stand_in: tf.Tensor
    slot_parts: Dict[str, List[tf.Variable]] = dataclasses.field(default_factory=dict)   # stand-in name -> shards

    @property
    def rows(self) -> int:
        return sum(int(part.shape[0]) for part in self.parts)

    def rows_of(self, grad: tf.IndexedSlices) -> List[tf.IndexedSlices]:
        """Each shard's rows of a gradient of the whole variable, with the shard's own ids."""
        count = len(self.parts)
        ids = tf.reshape(grad.indices, [-1])
        shard = tf.cast(tf.math.floormod(ids, count), tf.int32)
        local = tf.math.floordiv(ids, count)
        values = tf.reshape(grad.values, tf.concat([[-1], tf.shape(grad.values)[1:]], 0))

        def shape_of(part):
            return None if grad.dense_shape is None else tf.constant(part.shape.as_list(), grad.dense_shape.dtype)
        return [tf.IndexedSlices(v, i, shape_of(p)) for v, i, p in
                zip(tf.dynamic_partition(values, shard, count), tf.dynamic_partition(local, shard, count), self.parts)]


def apply_split(split: Shards, grad: tf.IndexedSlices, part_grads: List[tf.IndexedSlices]) -> Dict[tf.Operation, list]:
    """Rewrites the imported step's uses of `split.stand_in` (see the module doc). Returns each
    op replaced -> what replaces it (the ops that ran after it run after those)."""
    replaced: Dict[tf.Operation, list] = {}
    graph = split.stand_in.graph
    slots = [parts[0].graph.get_tensor_by_name(name) for name, parts in split.slot_parts.items()]
    writes = row_writes([split.stand_in, *slots], "")
    updates = sorted(update_ops(writes, grad), key=tf_shim.creation_order) if writes else []
    for op in updates:
        replaced[op] = []
    for k, part_grad in enumerate(part_grads):
        mapping = {split.stand_in.name: split.parts[k].handle}
        mapping.update({name: parts[k].handle for name, parts in split.slot_parts.items()})
        mapping.update({t.name: mine for t, mine in zip(components(grad), components(part_grad))})
        for op in updates:
            copied = _copy(graph, op, mapping, f"part_{k}")
            replaced[op].append(copied)
            mapping.update({t.name: c for t, c in zip(op.outputs, copied.outputs)})
    for op in list(split.stand_in.consumers()):
        if op.type == "ResourceGather" and op not in replaced:
            looked_up = tf.compat.v1.nn.embedding_lookup(split.parts, op.inputs[1], partition_strategy="mod")
            tf_shim.replace_uses(op.outputs[0], looked_up)
            replaced[op] = [looked_up.op]
        elif op.type == "VariableShape":
            shape = tf.constant([split.rows] + split.parts[0].shape[1:].as_list(), op.get_attr("out_type"))
            tf_shim.replace_uses(op.outputs[0], shape)
            replaced[op] = [shape.op]
    for op in [op for handle in (split.stand_in, *slots) for op in handle.consumers()]:
        if _dead_read(op):
            replaced[op] = []
    return replaced


def _copy(graph, op: tf.Operation, mapping: dict, suffix: str) -> tf.Operation:
    attrs = {k: v for k, v in op.node_def.attr.items() if k != "_class"}
    return graph.create_op(op.type, [mapping.get(t.name, t) for t in op.inputs], [t.dtype for t in op.outputs],
                           name=f"{op.name}_{suffix}", attrs=attrs, op_def=op.op_def)


def reorder(graph, replaced: Dict[tf.Operation, list]) -> None:
    """Every op that ran after a replaced op runs after what replaces it; a copy runs after what
    its original ran after (mapped the same way)."""
    def mapped(ops):
        out = []
        for op in ops:
            out.extend(replaced.get(op, [op]))
        return out

    if not replaced:
        return
    copies = {copy: original for original, made in replaced.items() for copy in made}
    for op in graph.get_operations():
        source = copies.get(op, op)
        controls = list(source.control_inputs)
        if not any(c in replaced for c in controls) and source is op:
            continue
        if op in replaced:          # an original, no longer run
            continue
        tf_shim.remove_all_control_inputs(op)
        tf_shim.add_control_inputs(op, [c for c in mapped(controls) if c is not op])
