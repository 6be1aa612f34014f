"""The graph's vocabulary and walks, shared by inspection and every rewriter.

The op types that name where a graph's values come from (inputs, tf.data iterators, variables),
which ops read or write a variable, and which ops only pass a value on; and the walks over ops'
inputs and consumers built on them. Every other module names these op types through this one
(tests/test_graph_walk.py checks it), so that inspection and the rewriters agree on them.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, List, Optional, Tuple

import tensorflow as tf

# The model's inputs: placeholders and what a tf.data iterator hands the step.
INPUT_OPS = frozenset({"Placeholder", "PlaceholderWithDefault", "IteratorGetNext", "IteratorGetNextSync"})
# The inputs a step must be given: a PlaceholderWithDefault (tf_keras's learning phase) runs without one.
FED_INPUT_OPS = INPUT_OPS - {"PlaceholderWithDefault"}
# Reads of a tf.data iterator, each one batch per step (an optional-valued read included).
ITERATOR_READ_OPS = frozenset({"IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional"})
# The iterator resources those reads read.
ITERATOR_OPS = frozenset({"Iterator", "IteratorV2", "AnonymousIterator", "AnonymousIteratorV2"})
# A feedable iterator, whose handle the script feeds at every step.
FEEDABLE_ITERATOR_OPS = frozenset({"IteratorFromStringHandle", "IteratorFromStringHandleV2"})
# A tf.data pipeline's split into shards (Dataset.shard), and the ops that run Python inside one
# (from_generator, py_function): what they read is invisible to the graph.
SHARD_DATASET_OPS = frozenset({"ShardDataset"})
PY_FUNC_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})

RESOURCE_VARIABLE_OPS = frozenset({"VarHandleOp"})
REF_VARIABLE_OPS = frozenset({"VariableV2", "Variable"})        # TF's legacy ref variables
VARIABLE_OPS = RESOURCE_VARIABLE_OPS | REF_VARIABLE_OPS
# Reads of a resource variable's value or rows: what a pull from its server moves.
RESOURCE_READ_OPS = frozenset({"ReadVariableOp", "ResourceGather"})
WRITE_OPS = frozenset({
    "Assign", "AssignAdd", "AssignSub", "AssignVariableOp", "AssignAddVariableOp",
    "AssignSubVariableOp", "ScatterUpdate", "ScatterAdd", "ScatterSub", "ScatterMul",
    "ScatterDiv", "ScatterNdUpdate", "ScatterNdAdd", "ResourceScatterUpdate",
    "ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterMul",
    "ResourceScatterDiv", "ResourceScatterNdUpdate", "ResourceScatterNdAdd"})

# Pass-through ops, each set for what a walk looks for beyond them:
# a variable's whole value, unchanged (a resource read, a ref variable's read): its first real users;
VALUE_READ_OPS = frozenset({"ReadVariableOp", "Identity"})
# a tensor's values, retyped or reshaped: the op that computed them (e.g. a lookup's ids);
VALUE_PASS_THROUGH_OPS = frozenset({"Identity", "Cast", "Reshape"})
# a resource handle on its way to a reader (a copy, a while loop's entry): the op that made it;
HANDLE_PASS_THROUGH_OPS = frozenset({"Identity", "Enter"})
# a weight also through loop plumbing, concatenation, splits and transposes (an LSTM's joined
# kernels): the op that uses it as a layer does, which names the layer's kind.
WEIGHT_PASS_THROUGH_OPS = frozenset({"Identity", "ReadVariableOp", "Cast", "Enter", "Switch", "Merge", "Reshape",
                                     "ConcatV2", "Split", "SplitV", "Transpose"})


def _as_op(op_or_tensor) -> tf.Operation:
    return op_or_tensor if isinstance(op_or_tensor, tf.Operation) else op_or_tensor.op


def reachable(starts: Iterable[tf.Operation], step: Callable[[tf.Operation], Iterable[tf.Operation]]) -> set:
    """Every op reached from `starts` (included) by following `step(op)` again and again."""
    seen, stack = set(), list(starts)
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend(step(op))
    return seen


def _inputs(op, data_only: bool = False) -> list:
    data = [t.op for t in op.inputs]
    return data if data_only else data + list(op.control_inputs)


def ancestors(op, data_only: bool = False, stop: Iterable[tf.Operation] = frozenset()) -> set:
    """`op` (or a tensor's op) and all it depends on, by data and control inputs (or data only), not past `stop`."""
    stop = stop if isinstance(stop, (set, frozenset)) else set(stop)
    return reachable([_as_op(op)], lambda current: () if current in stop else _inputs(current, data_only))


def needed_placeholders(*targets) -> List[str]:
    """Names of the placeholders `targets` (ops or tensors) need fed."""
    found = reachable([_as_op(t) for t in targets], _inputs)
    return sorted(op.name for op in found if op.type == "Placeholder")


def descendants(starts: Iterable[tf.Operation], within: Optional[set] = None) -> set:
    """Every op reached from `starts` (included) along data edges, inside `within` when given."""
    return reachable([op for op in starts if within is None or op in within],
                     lambda op: [c for t in op.outputs for c in t.consumers() if within is None or c in within])


def reads_of(tensor: tf.Tensor, through, within: Optional[set] = None,
             max_depth: Optional[int] = None) -> Iterator[Tuple[tf.Operation, tf.Tensor]]:
    """(op, tensor it reads) per op using `tensor`'s values past `through` ops: once each, nearest first."""
    frontier, seen, depth = [tensor], set(), 0
    while frontier and (max_depth is None or depth < max_depth):
        next_frontier = []
        for current in frontier:
            for op in current.consumers():
                if op in seen or (within is not None and op not in within):
                    continue
                seen.add(op)
                if op.type in through:
                    next_frontier.extend(op.outputs)
                else:
                    yield op, current
        frontier, depth = next_frontier, depth + 1


def users(tensor: tf.Tensor, through, within: Optional[set] = None, max_depth: Optional[int] = None) -> list:
    """The ops using `tensor`'s values past `through` ops (in `within`, at most `max_depth` ops deep)."""
    return [op for op, _ in reads_of(tensor, through, within, max_depth)]


def feeding_op(tensor: tf.Tensor, through) -> tf.Operation:
    """The op feeding `tensor`, looking back through ops in `through` (along their first input)."""
    op = tensor.op
    while op.type in through and op.inputs:
        op = op.inputs[0].op
    return op
