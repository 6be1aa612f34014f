"""Small constants made again on every task that reads them (placement.settle's last rule).

TF sends a tensor that crosses tasks in a RecvTensor call of its own every step, constants
included: an optimizer's hyper-parameters beside every shard's apply on its server, a slice's
bounds. A small constant another task reads is made again there, and so is a small value that
stateless ops compute from constants alone (FTRL's l2 + beta / (2 lr)): its ops are made again
there with it, so each task computes the same value from the same operations. What waits on a
control input stays where it is: its copy would wait across tasks instead.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from parallax_tf.compat import tensorflow as tf_shim

SMALL_CONSTANT_BYTES = 64 * 1024
# The most ops one copy makes: an optimizer's arithmetic on its hyper-parameters takes a few; a
# longer computation is sent, as TF would.
MAX_COPIED_OPS = 32

# What a copy may compute: elementwise arithmetic and shape ops, deterministic and without state
# or side effects (a collective or a placeholder made again would change what the step does).
COMPUTED = frozenset({
    "Identity", "Cast", "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Neg", "Reciprocal",
    "Sqrt", "Rsqrt", "Square", "Pow", "Exp", "Log", "Abs", "Sign", "Floor", "FloorDiv", "FloorMod",
    "Maximum", "Minimum", "Less", "LessEqual", "Greater", "GreaterEqual", "Equal", "NotEqual",
    "LogicalAnd", "LogicalOr", "LogicalNot", "Select", "SelectV2", "Reshape", "Pack", "ConcatV2",
    "StridedSlice", "Slice", "ExpandDims", "Squeeze", "Fill", "Range", "Shape", "Size", "Rank",
    "ZerosLike", "OnesLike", "Sum", "Prod", "Max", "Min", "Tile", "Transpose"})
_NOT_COPIED_DTYPES = (tf.resource, tf.variant, tf.string)


def copy_constants_to_readers(graph) -> int:
    """Gives every task that reads a small constant of another task its own copy of it (and of
    the ops it is computed from). Returns how many ops it made."""
    constant = _Constants()
    copies: Dict[Tuple[str, tuple], tf.Operation] = {}
    for op in [op for op in graph.get_operations() if constant(op)]:
        home = _task(op.device)
        readers = [(consumer, index, tensor) for tensor in op.outputs for consumer in tensor.consumers()
                   for index, read in enumerate(consumer.inputs) if read is tensor and _task(consumer.device) != home]
        for consumer, index, tensor in readers:
            copy = _copy(graph, op, consumer.device, copies)
            if copy is not None:
                tf_shim.update_input(consumer, index, copy.outputs[tensor.value_index])
    return len(copies)


class _Constants:
    """constant(op): whether `op` is a small constant, or computes one from constants alone.
    Decided inputs first, without recursion (a chain of small ops can be thousands deep)."""

    def __init__(self):
        self._known: Dict[tf.Operation, bool] = {}

    def __call__(self, op) -> bool:
        stack, open_ops = [op], set()
        while stack:
            current = stack[-1]
            if current in self._known:
                stack.pop()
                continue
            # an input still open is a cycle (a loop's back edge): read as not a constant
            waiting = [t.op for t in current.inputs if t.op not in self._known and t.op not in open_ops] \
                if current not in open_ops and _may_be_constant(current) else []
            if waiting:
                open_ops.add(current)
                stack.extend(waiting)
                continue
            stack.pop()
            open_ops.discard(current)
            self._known[current] = _may_be_constant(current) and (
                current.type == "Const" or all(self._known.get(t.op, False) for t in current.inputs))
        return self._known[op]


def _may_be_constant(op) -> bool:
    """What `op` itself must be for its output to be a copied constant: a small Const, or a
    COMPUTED op with inputs and small outputs; nothing waiting on a control input."""
    if op.control_inputs or any(t.dtype in _NOT_COPIED_DTYPES for t in op.outputs):
        return False
    if op.type == "Const":
        return op.get_attr("value").ByteSize() <= SMALL_CONSTANT_BYTES
    return op.type in COMPUTED and bool(op.inputs) and all(_small(t) for t in op.outputs)


def _small(tensor) -> bool:
    elements = tensor.shape.num_elements()
    return elements is not None and elements * tensor.dtype.size <= SMALL_CONSTANT_BYTES


def _copy(graph, op, device: str, copies: dict) -> Optional[tf.Operation]:
    """`op` made again on `device`'s task, with what it reads from other tasks made there first;
    None (nothing made) when that takes more than MAX_COPIED_OPS ops."""
    task = _task(device)
    order = _to_make(op, task, copies)
    if order is None:
        return None
    for current in order:
        inputs = [t if _task(t.op.device) == task else copies[(t.op.name, task)].outputs[t.value_index]
                  for t in current.inputs]
        attrs = {name: value for name, value in current.node_def.attr.items() if not name.startswith("_")}
        with graph.as_default(), tf.control_dependencies(None), tf.device(device):
            copies[(current.name, task)] = tf_shim.create_op(
                graph, current.type, inputs, [t.dtype for t in current.outputs], attrs,
                name=f"{current.name}_on_{task[0]}_{task[1]}")
    return copies[(op.name, task)]


def _to_make(op, task, copies: dict) -> Optional[List[tf.Operation]]:
    """The ops `op`'s copy on `task` needs made, inputs first (those of other tasks not made
    there yet); None past MAX_COPIED_OPS."""
    order, seen, stack = [], set(), [(op, False)]
    while stack:
        current, inputs_made = stack.pop()
        if inputs_made:
            order.append(current)
            continue
        if current in seen or (current.name, task) in copies:
            continue
        seen.add(current)
        if len(seen) > MAX_COPIED_OPS:
            return None
        stack.append((current, True))
        stack.extend((t.op, False) for t in current.inputs if _task(t.op.device) != task)
    return order


def _task(device: str):
    spec = tf.DeviceSpec.from_string(device) if device else tf.DeviceSpec()
    return spec.job, spec.task
