"""The user's gradient transform, made to see the global gradient.

Between the raw gradients (tf.gradients / compute_gradients) and the optimizer applies a train
op may transform gradients: clip them by their global norm, scale them, multiply some of them.
Single-device semantics means the transform sees the gradient of the global batch, so its
inputs are rewired from this rank's raw gradients to the global ones:
- AllReduce variables: every rank has the global gradient after the allreduce; the transform
  and the apply run on every rank.
- PS variables: the global gradient exists on the server after aggregation; rank 0 runs the
  transform and the apply there. What the other ranks' transforms need from a PS variable's
  gradient is computed where it is and moved as a few numbers, never the whole gradient:
  * dense PS variable: each small tensor its per-variable ops hand to the rest of the
    transform (e.g. its L2Loss inside a global norm) travels in rank 0's token;
  * sparse PS variable: TF reduces an IndexedSlices over its rows as gathered, repeats
    included, and the global batch's rows are all ranks' rows: such a reduction (L2Loss, a
    full Sum) is a sum over ranks of per-rank sums, added up by one allreduce of scalars.
A transform that needs more (a PS variable's whole gradient mixed with another's, a non-linear
change of a sparse PS variable's rows before the apply) cannot be distributed exactly and
gets a ModelError naming the op.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List

import tensorflow as tf

from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.errors import ModelError
from parallax_tf.graph_walk import ancestors, descendants

_REDUCTIONS = {"L2Loss", "Sum"}
# Element-wise ops a sparse PS variable's rows may pass through on the way to a reduction.
_ELEMENTWISE = {"Identity", "Square", "Mul", "Abs", "Neg", "Cast", "RealDiv", "Div", "Sign", "Sqrt",
                "AddV2", "Add", "Sub", "Maximum", "Minimum", "Pow", "Exp", "Log", "Tanh"}
# ...and the linear ones that may lie between its raw rows and the apply.
_LINEAR = {"Identity", "Mul", "RealDiv", "Div", "Neg", "Cast"}
_MAX_CROSSING_ELEMENTS = 64


def components(grad) -> Dict[str, tf.Tensor]:
    if isinstance(grad, tf.IndexedSlices):
        out = {"values": grad.values, "indices": grad.indices}
        if grad.dense_shape is not None:
            out["dense_shape"] = grad.dense_shape
        return out
    return {"dense": grad}


@dataclasses.dataclass
class Transform:
    """The ops between the raw gradients and the train op, with the variables each depends on."""
    raw: Dict[str, object]                      # variable op name -> the user's raw gradient
    applied: Dict[str, object]                  # variable op name -> what its apply consumes
    optimizer_ops: set                          # op names the optimizers created
    depends: Dict[tf.Operation, frozenset]      # op -> variables whose raw gradient reaches it


def analyse(training, needed: set) -> Transform:
    raw = {name: grad for name, (grad, _) in training.raw_gradients().items() if name in training.applied()}
    applied = {name: g for name, (g, _, _) in training.applied().items()}
    source = {t.name: name for name, grad in raw.items() for t in components(grad).values()}
    region = descendants({op for grad in raw.values() for t in components(grad).values() for op in t.consumers()},
                         within=needed)
    depends: Dict[tf.Operation, frozenset] = {}
    for op in sorted(region, key=tf_shim.creation_order):   # inputs come first
        deps = set()
        for t in op.inputs:
            if t.name in source:
                deps.add(source[t.name])
            elif t.op in depends:
                deps |= depends[t.op]
        depends[op] = frozenset(deps)
    return Transform(raw, applied, training.created_by_optimizers(), depends)


def check_sparse_rows(transform: Transform, sparse_on_ps: set) -> Dict[str, list]:
    """For each sparse PS variable: (reduction op, the element-wise ops from its raw rows to it).
    Raises ModelError where its rows cannot be handled exactly (see the module doc)."""
    found = {}
    for var in sorted(sparse_on_ps & set(transform.raw)):
        values = transform.raw[var].values
        to_apply = transform.applied[var]
        target = to_apply.values if isinstance(to_apply, tf.IndexedSlices) else to_apply
        on_the_way = ancestors(target.op) | {target.op}
        path, reductions, frontier = set(), [], [values]
        while frontier:
            tensor = frontier.pop()
            for op in tensor.consumers():
                if op not in transform.depends or op in path or op in reductions \
                        or op.name in transform.optimizer_ops:   # the optimizer's own apply
                    continue
                if op.type in _REDUCTIONS and op.outputs[0].shape.num_elements() == 1:
                    reductions.append(op)
                    continue
                rows_in = [t for t in op.inputs if t is values or t.op in path]
                others_small = all(_small(t) for t in op.inputs if not (t is values or t.op in path))
                linear = op.type in _LINEAR and len(rows_in) == 1 and not (
                    op.type in ("RealDiv", "Div") and op.inputs[0] is not rows_in[0])
                if op.type not in _ELEMENTWISE or not others_small:
                    raise ModelError(f"gradient transform op {op.name!r} ({op.type}) mixes the rows of sparse PS "
                                     f"variable {var!r} with other large tensors; parallax_tf cannot compute that "
                                     "without moving the whole gradient. Reduce the rows first (a norm) or put "
                                     "the variable on AllReduce (--strategy=allreduce)")
                if op in on_the_way and not linear:
                    raise ModelError(f"gradient transform op {op.name!r} ({op.type}) changes the rows of sparse PS "
                                     f"variable {var!r} before its apply in a way that is not linear; the server "
                                     "sees the rows of all ranks summed, so it cannot apply that exactly. Scale "
                                     "or clip by norms only, or put the variable on AllReduce (--strategy=allreduce)")
                path.add(op)
                frontier.extend(op.outputs)
        found[var] = [(r, [op for op in path if op in ancestors(r)]) for r in reductions]
    return found


def crossing_tensors(transform: Transform, on_ps: set, needed_elsewhere: set) -> List[tuple]:
    """(tensor, variable) results of PS gradients that ranks other than 0 need: computed on rank
    0 from the global gradient, sent in its token. Each must be small."""
    source = {t.name: var for var in on_ps & set(transform.raw) for t in components(transform.raw[var]).values()}
    crossing = []
    candidates = [(t, frozenset([var])) for var in on_ps & set(transform.raw)
                  for t in components(transform.raw[var]).values()]
    candidates += [(t, deps) for op, deps in transform.depends.items() if deps and deps <= on_ps for t in op.outputs]
    for tensor, deps in candidates:
        users = [c for c in tensor.consumers() if c in needed_elsewhere
                 and not (c in transform.depends and transform.depends[c] <= on_ps)]
        if not users:
            continue
        count = tensor.shape.num_elements()
        if count is None or count > _MAX_CROSSING_ELEMENTS:
            raise ModelError(
                f"gradient transform op {users[0].name!r} combines the gradient of PS variable(s) {sorted(deps)} "
                f"with others through {tensor.name} of shape {tensor.shape}; parallax_tf moves only small "
                f"results of PS gradients (norms, sums; at most {_MAX_CROSSING_ELEMENTS} numbers) between ranks. "
                "Put the variable on AllReduce (--strategy=allreduce) or reduce it per variable first")
        crossing.append((tensor, source.get(tensor.name) or sorted(deps)[0]))
    return sorted(crossing, key=lambda item: item[0].name)


def _small(tensor) -> bool:
    count = tensor.shape.num_elements()
    return count is not None and count <= _MAX_CROSSING_ELEMENTS


def rewire(consumers_of: tf.Tensor, replacement: tf.Tensor, needed: set, skip=()) -> None:
    """Every op in `needed` (not in `skip`) that reads `consumers_of` reads `replacement` instead."""
    if replacement.dtype != consumers_of.dtype:
        replacement = tf.cast(replacement, consumers_of.dtype)
    for op in list(consumers_of.consumers()):
        if op in needed and op not in skip:
            for index, tensor in enumerate(op.inputs):
                if tensor is consumers_of:
                    tf_shim.update_input(op, index, replacement)


def feed_global_gradients(transform: Transform, global_grads: Dict[str, object], needed: set) -> None:
    """The transform (and apply) of every variable with a global gradient on this rank reads it."""
    for var, grad in global_grads.items():
        if var not in transform.raw:
            continue
        mine, theirs = components(transform.raw[var]), components(grad)
        if set(mine) != set(theirs) and set(mine) != set(theirs) - {"dense_shape"}:
            raise ModelError(f"the raw gradient of {var!r} is a {type(transform.raw[var]).__name__} but the "
                             f"route delivers a {type(grad).__name__}; this model is not supported yet")
        for key, tensor in mine.items():
            rewire(tensor, theirs[key], needed)


def sum_sparse_reductions(transform: Transform, reductions: Dict[str, list], own_rows: Dict[str, tf.Tensor],
                          num_ranks: int, needed: set):
    """Replaces each reduction of a sparse PS variable's rows by the sum over ranks of the same
    reduction of each rank's own rows (divided by the rank count, as averaging does). Returns
    the allreduce (every rank must run it every step, whether or not its transform needs it),
    or None."""
    import horovod.tensorflow as hvd
    partials, targets = [], []
    for var, found in reductions.items():
        rows = own_rows[var] / tf.cast(num_ranks, own_rows[var].dtype)
        for reduction, chain in found:
            partial = _copy_chain(reduction, chain, transform.raw[var].values, rows)
            partials.append(tf.reshape(tf.cast(partial, tf.float64), []))
            targets.append(reduction.outputs[0])
    if not partials:
        return None
    stacked = tf.stack(partials)
    total = hvd.allreduce(stacked, op=hvd.Sum, name="parallax_transform_sums") if num_ranks > 1 else stacked
    for i, tensor in enumerate(targets):
        rewire(tensor, tf.reshape(tf.cast(total[i], tensor.dtype), tensor.shape), needed)
    return total


def _copy_chain(reduction: tf.Operation, chain: list, source: tf.Tensor, replacement: tf.Tensor) -> tf.Tensor:
    """A copy of the element-wise `chain` and `reduction`, reading `replacement` for `source`."""
    mapping = {source.name: replacement}
    graph = reduction.graph
    for op in sorted(set(chain) | {reduction}, key=tf_shim.creation_order):
        attrs = {k: v for k, v in op.node_def.attr.items() if k != "_class"}
        copied = graph.create_op(op.type, [mapping.get(t.name, t) for t in op.inputs],
                                 [t.dtype for t in op.outputs], name=op.name.split("/")[-1] + "_rank_share",
                                 attrs=attrs, op_def=op.op_def)
        mapping.update({t.name: c for t, c in zip(op.outputs, copied.outputs)})
    return mapping[reduction.outputs[0].name]


def pack(frontier: List[tuple]) -> tf.Tensor:
    """Rank 0: the small PS-side results other ranks need, as one float64 vector."""
    pieces = [tf.reshape(tf.cast(t, tf.float64), [-1]) for t, _ in frontier]
    return tf.concat(pieces, 0) if pieces else tf.zeros([0], tf.float64)


def unpack(frontier: List[tuple], payload: tf.Tensor, needed: set) -> None:
    """Other ranks: the rest of the transform reads rank 0's results from the token."""
    offset = 0
    for tensor, _ in frontier:
        count = int(tensor.shape.num_elements())
        value = tf.reshape(tf.cast(payload[offset:offset + count], tensor.dtype), tensor.shape)
        rewire(tensor, value, needed)
        offset += count


def place_next_to_variables(transform: Transform, devices: Dict[str, str]) -> None:
    """Rank 0: a PS variable's own transform ops run on its server, so its global gradient
    never leaves it (only what other variables need crosses)."""
    for op, deps in transform.depends.items():
        if len(deps) == 1:
            device = devices.get(next(iter(deps)))
            if device:
                tf_shim.set_device(op, device)
