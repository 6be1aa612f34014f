"""What every rewriter shares: rebuild model_fn under the plan's placement, take gradients,
and describe the resulting distributed graph for the runtime."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Dict, List, Optional

import tensorflow as tf

from parallax_tf.errors import ModelError
from parallax_tf.inspect_graph import call_model_fn, logical_name
from parallax_tf.model import RunContext
from parallax_tf.plan import ROUTE_PS, Plan
from parallax_tf.values import Part

_VARIABLE_OPS = {"VarHandleOp", "VariableV2", "Variable"}


@dataclasses.dataclass
class Topology:
    """Who runs where, as the rewriter needs it (plain data; the runtime fills it)."""
    rank: int
    size: int
    local_rank: int
    local_size: int
    host: int                  # index of this rank's host = index of the PS task on it
    ranks_per_host: List[int]  # number of ranks on each host

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def worker_device(self) -> str:
        return f"/job:worker/task:{self.rank}"

    def host_of(self, rank: int) -> int:
        start = 0
        for host, count in enumerate(self.ranks_per_host):
            start += count
            if rank < start:
                return host
        raise ValueError(f"rank {rank} is on no host of {self.ranks_per_host}")


@dataclasses.dataclass
class BuildRequest:
    """Everything a rewriter gets: the user's model_fn and the decisions already taken."""
    model_fn: Callable
    ctx: RunContext
    plan: Plan
    topology: Topology
    seed: int


@dataclasses.dataclass
class DistributedGraph:
    graph: tf.Graph
    loss: tf.Tensor
    mean_loss: tf.Tensor                        # the loss averaged over ranks
    train_op: tf.Operation
    global_step: tf.Tensor                      # read of the one global step
    parts: Dict[str, List[Part]]                # logical name -> its pieces in this graph
    chief_init: List[tf.Operation]              # run once by rank 0: PS state, slots, step
    local_init: tf.Operation                    # run by every rank: local replicas' state
    broadcast: Optional[tf.Operation]           # dense replicas from rank 0 to all
    barrier: tf.Operation                       # a cross-rank rendezvous
    bytes_per_step: Dict[str, tf.Tensor]        # route -> bytes this rank moved in the step
    lower_bound_bytes: tf.Tensor = None         # the least the plan's variables need per step
    global_step_var: tf.Variable = None
    # (optimizer, variables it updates in this graph): where slots and non-slot state live
    optimizers: List[tuple] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Rebuilt:
    model: object
    parts: Dict[str, List[Part]]
    grads: Dict[str, list]                      # logical name -> gradient per part (or None)


def rebuild(request: BuildRequest) -> Rebuilt:
    """Calls model_fn in the current default graph with variables placed as the plan says:
    PS shards on their server (TF's partitioner splits variables the plan shards), everything
    else, ops included, on this rank's worker device."""
    plan, topo = request.plan, request.topology
    graph = tf.compat.v1.get_default_graph()
    ps_device = {s.name: f"/job:ps/task:{s.server}" for v in plan.on_route(ROUTE_PS) for s in v.shards}
    auto_parts = {v.name: v.partitions for v in plan.on_route(ROUTE_PS)
                  if v.partitions > 1 and not v.user_partitioned}

    def place(op):
        if op.type in _VARIABLE_OPS and op.name in ps_device:
            return ps_device[op.name]
        return op.device or topo.worker_device

    def getter(getter, name, *args, **kwargs):  # TF passes the next getter as `getter`
        kwargs["use_resource"] = True
        if name in auto_parts:
            kwargs["partitioner"] = tf.compat.v1.fixed_size_partitioner(auto_parts[name])
        return getter(name, *args, **kwargs)

    def resource_creator(next_creator, **kwargs):
        kwargs["use_resource"] = True   # reads of PS variables then run on the PS (only rows move)
        return next_creator(**kwargs)

    tf.compat.v1.set_random_seed(request.seed)
    with contextlib.ExitStack() as stack:
        stack.enter_context(graph.device(place))  # a device function: tf.device takes only strings
        stack.enter_context(tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(), custom_getter=getter))
        stack.enter_context(tf.variable_creator_scope(resource_creator))
        model = call_model_fn(request.model_fn, request.ctx)
    parts = _parts_by_logical_name(plan)
    missing = set(plan.by_name()) - set(parts)
    extra = set(parts) - set(plan.by_name())
    if missing or extra:
        raise ModelError(f"model_fn built different variables the second time (missing {sorted(missing)}, "
                           f"new {sorted(extra)}); model_fn must build the same graph every call")
    sparse_on_ps = {v.name for v in plan.on_route(ROUTE_PS) if v.gradient == "sparse"}
    with tf.device(topo.worker_device):
        grads = gradients(model.loss, parts, sparse_on_ps)
    return Rebuilt(model=model, parts=parts, grads=grads)


def gradients(loss, parts: Dict[str, List[Part]], sparse_on_ps) -> Dict[str, list]:
    """Gradient per part. For a sparse variable on a PS, it is built here (on the worker) from
    the gradient of each lookup's output, as TF's own ResourceGather gradient does: TF would
    colocate those ops with the variable, sending every looked-up row, repeats included, to
    the server and back before the de-duplicated push."""
    needed = ancestors(loss.op)
    xs, recipe = [], []                      # recipe: per part, ("var", i) or ("lookups", [(op, i)])
    for name, pieces in parts.items():
        for part in pieces:
            readers = [op for op in part.variable.handle.consumers() if op in needed]
            lookups = [op for op in readers if op.type == "ResourceGather" and op.get_attr("batch_dims") == 0]
            if name in sparse_on_ps and lookups and len(lookups) == len(readers):
                recipe.append(("lookups", [(op, len(xs) + k) for k, op in enumerate(lookups)]))
                xs.extend(op.outputs[0] for op in lookups)
            else:
                recipe.append(("var", len(xs)))
                xs.append(part.variable)
    dys = tf.gradients(loss, xs)
    flat = []
    for (kind, where), part in zip(recipe, [p for pieces in parts.values() for p in pieces]):
        if kind == "var":
            flat.append(dys[where])
            continue
        var = part.variable
        row_shape = var.shape[1:].as_list()
        pieces = [(tf.reshape(dys[i], [-1] + row_shape), tf.reshape(op.inputs[1], [-1]))
                  for op, i in where if dys[i] is not None]
        if not pieces:
            flat.append(None)
            continue
        values = tf.concat([v for v, _ in pieces], 0) if len(pieces) > 1 else pieces[0][0]
        indices = tf.concat([tf.cast(i, tf.int64) for _, i in pieces], 0) if len(pieces) > 1 else pieces[0][1]
        flat.append(tf.IndexedSlices(values, indices, tf.constant(var.shape.as_list(), tf.int64)))
    grads, i = {}, 0
    for name, pieces in parts.items():
        grads[name] = flat[i:i + len(pieces)]
        i += len(pieces)
    return grads


def ancestors(op) -> set:
    """Every op `op` depends on (data and control)."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        stack.extend(t.op for t in current.inputs)
        stack.extend(current.control_inputs)
    return seen


def _parts_by_logical_name(plan: Plan) -> Dict[str, List[Part]]:
    entries = plan.by_name()
    parts: Dict[str, List[Part]] = {}
    for var in tf.compat.v1.trainable_variables():
        parts.setdefault(logical_name(var), []).append(var)
    out = {}
    for name, variables in parts.items():
        entry = entries.get(name)
        if entry is not None and entry.shards:
            by_name = {v.op.name: v for v in variables}
            out[name] = [Part(by_name[s.name], s.row_start, s.row_end) for s in entry.shards]
        else:
            variables.sort(key=lambda v: v.op.name)
            start, pieces = 0, []
            for v in variables:
                rows = int(v.shape[0]) if v.shape.rank else 1
                pieces.append(Part(v, start, start + rows))
                start += rows
            out[name] = pieces
    return out


def clone_optimizer(optimizer):
    """A second optimizer with the same hyper-parameters and no state.

    Variables updated by every rank (replicas) and by the chief alone (PS) need separate
    non-slot state (Adam's beta powers), so each apply domain gets its own instance.
    The v1 Optimizer keeps its state in these three dicts, filled only by apply_gradients."""
    import copy
    twin = copy.copy(optimizer)
    twin._slots, twin._non_slot_dict, twin._deferred_slot_restorations = {}, {}, {}
    return twin


def optimizer_state(optimizer, variables) -> List[tf.Variable]:
    """Slots and non-slot variables an optimizer created for `variables`."""
    state = [optimizer.get_slot(v, n) for v in variables for n in optimizer.get_slot_names()]
    return [s for s in state if s is not None] + list(optimizer._non_slot_dict.values())


def barrier_op(name: str) -> tf.Operation:
    import horovod.tensorflow as hvd
    # The input must not be a constant: grappler would fold the allreduce on the first run and
    # every later run of the cached graph would pass without waiting for anyone.
    return hvd.allreduce(tf.random.uniform([]), op=hvd.Sum, name=name).op


def tensor_bytes(t) -> tf.Tensor:
    """Bytes of a tensor or IndexedSlices, as an int64 scalar computed at run time."""
    if isinstance(t, tf.IndexedSlices):
        return tensor_bytes(t.values) + tensor_bytes(t.indices)
    return tf.cast(tf.size(t, out_type=tf.int64), tf.int64) * t.dtype.size
