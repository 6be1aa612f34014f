"""How a traced step reads and updates a table's rows.

`rows_each`: the sparse variables whose apply does more with its gradient's rows than scale and
sum them, so a route must hand it every row (repeated ids) rather than one per id.
`read_rows_only`: a lookup that reads the whole table and gathers from the value becomes a
gather from the variable, so a table on the parameter servers moves only its looked-up rows."""
from __future__ import annotations

import tensorflow as tf

# What a sparse gradient's rows may pass through in an apply that adds repeated rows up: scaling
# by what does not depend on them, and the ops that sum rows into a variable or a dense tensor.
_ROW_SCALING = frozenset({"Identity", "Cast", "Neg", "Mul", "RealDiv", "Div", "Reshape", "ExpandDims", "Squeeze"})
_ROW_SUMS = frozenset({"UnsortedSegmentSum", "ResourceScatterAdd", "ResourceScatterSub", "ScatterNd",
                       "TensorScatterAdd", "TensorScatterSub"})


def rows_each(trace_updates: list) -> set:
    """id(variable) of each sparse variable whose apply (an update's `ops`, for its (gradient,
    variable) `pairs`) does something else with its gradient's rows than scale and sum them
    (Keras 3's Adam and Adagrad square each row): summed per id before the apply, repeated ids
    would change what it computes."""
    found = set()
    for update in trace_updates:
        made = set(update.ops)
        for grad, variable in update.pairs:
            if isinstance(grad, tf.IndexedSlices) and not _adds_rows_up(grad.values, made):
                found.add(id(variable))
    return found


def _adds_rows_up(values, within: set) -> bool:
    frontier, seen = [values], set()
    while frontier:
        tensor = frontier.pop()
        for consumer in tensor.consumers():
            if consumer not in within or consumer in seen:
                continue
            seen.add(consumer)
            if consumer.type in _ROW_SUMS:
                continue
            if consumer.type == "IdentityN":
                frontier.extend(out for out, given in zip(consumer.outputs, consumer.inputs) if given is tensor)
                continue
            if consumer.type not in _ROW_SCALING:
                return False
            if consumer.type in ("Mul", "RealDiv", "Div") and all(_depends_on(i, values) for i in consumer.inputs):
                return False
            frontier.extend(consumer.outputs)
    return True


def _depends_on(tensor, source) -> bool:
    return tensor is source or source.name in data_sources(tensor.op)


def components(grad) -> list:
    """A gradient's tensors: an IndexedSlices' values, indices and dense shape (those it has)."""
    if isinstance(grad, tf.IndexedSlices):
        return [t for t in (grad.values, grad.indices, grad.dense_shape) if t is not None]
    return [grad] if grad is not None else []


def data_sources(op) -> set:
    """The names of every tensor `op`'s data inputs are computed from (not through the step's
    order of stateful ops); an IdentityN passes each input to its own output only."""
    found, frontier = set(), list(op.inputs)
    while frontier:
        tensor = frontier.pop()
        if tensor.name in found:
            continue
        found.add(tensor.name)
        source = tensor.op
        frontier.extend([source.inputs[tensor.value_index]] if source.type == "IdentityN" else source.inputs)
    return found


def read_rows_only(graph_def, handles: set) -> None:
    """A Keras 3 lookup reads its whole table and gathers rows from the value (GatherV2 of a
    ReadVariableOp, Shape of one to clamp the ids): on a parameter server that moves the table
    every step. It reads the rows from the variable instead (ResourceGather, VariableShape), as a
    tf.compat.v1 lookup does."""
    nodes = {node.name: node for node in graph_def.node}

    def variable_read(name: str):
        read = nodes.get(name.split(":")[0])
        return read.input[0] if read is not None and read.op == "ReadVariableOp" and read.input[0] in handles else None

    for node in graph_def.node:
        handle = variable_read(node.input[0]) if node.input else None
        if handle is None:
            continue
        if node.op == "GatherV2" and node.attr["batch_dims"].i == 0 and _constant(nodes, node.input[2]) == 0:
            dtype, index_type = node.attr["Tparams"].type, node.attr["Tindices"].type
            node.op = "ResourceGather"
            node.input[:] = [handle, node.input[1]] + [i for i in node.input[3:] if i.startswith("^")]
            node.attr.clear()
            node.attr["dtype"].type, node.attr["Tindices"].type = dtype, index_type
            node.attr["batch_dims"].i = 0
            node.attr["validate_indices"].b = True
        elif node.op == "Shape":
            node.op = "VariableShape"
            node.input[0] = handle


def _constant(nodes: dict, name: str):
    node = nodes.get(name.split(":")[0])
    if node is None or node.op != "Const":
        return None
    value = tf.make_ndarray(node.attr["value"].tensor)
    return int(value) if value.ndim == 0 else None
