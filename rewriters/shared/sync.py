"""Assembles a synchronous data-parallel graph from the PS and AllReduce routes around the
model's own train op.

Every rank builds the user's graph (train op included), takes its own raw gradients and sends
them along the routes; the train op's transform and applies are rewired to read the global
gradients (rewriters/shared/transform.py). AllReduce variables are then updated by every rank, PS
variables by rank 0 next to the variable. On the other ranks, every op that writes a PS
variable (its apply, the global-step increment) is rank 0's alone: what depended on it waits
for rank 0's token instead, which also carries what their transform needs from PS gradients.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence

import tensorflow as tf

from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.errors import ModelError
from parallax_tf.plan import ROUTE_ALLREDUCE, ROUTE_PS
from parallax_tf.runtime.barriers import CollectiveBarrier
from parallax_tf.runtime.runner import SyncRunner, SyncStep
from parallax_tf.strategy import BuildRequest, DistributedGraph
from rewriters.shared.allreduce_route import AllReduceRoute
from rewriters.shared.ps_route import PSRoute
from rewriters.shared import transform as transform_lib
from rewriters.shared.pruning import needed_without, without, written_variables
from rewriters.shared.rebuild import advancing_global_step, ancestors, rebuild
from rewriters.shared.step_report import StepReport



def assemble(request: BuildRequest, allowed_routes: Sequence[str], strategy: str,
             extra_routes: Optional[Dict[str, Callable]] = None) -> DistributedGraph:
    """`extra_routes`: route name -> factory(request, rebuilt, entries) of a route object with
    build() (variable -> the gradient the model's transform reads), after_step(step targets)
    (builds what follows the step; returns targets every step also runs), finish(broadcast)
    (what it adds to the graph: a RouteState), and `bytes` / `lower_bound` like the PS and
    AllReduce routes."""
    plan, topo = request.plan, request.topology
    extra_routes = extra_routes or {}
    other = sorted({v.route for v in plan.trained} - set(allowed_routes) - set(extra_routes))
    if other:
        raise ValueError(f"the {strategy} rewriter cannot build route(s) {other}")
    rebuilt = rebuild(request, distinct_pulls=True)
    training = rebuilt.training
    if all(g is None for grads in rebuilt.grads.values() for g in grads):
        raise ModelError("no trainable variable gets a gradient from the loss: check that the loss "
                         "depends on the model's variables")
    ps_entries, ar_entries = plan.on_route(ROUTE_PS), plan.on_route(ROUTE_ALLREDUCE)
    target, global_step = advancing_global_step(training, "/job:ps/task:0" if ps_entries else topo.worker_device)
    ps_parts = {p.variable.op.name: p.variable for e in ps_entries for p in rebuilt.parts[e.name]}
    on_ps, sparse_on_ps = set(ps_parts), {p.variable.op.name for e in ps_entries if e.gradient == "sparse"
                                          for p in rebuilt.parts[e.name]}
    needed = ancestors(target)
    transform = transform_lib.analyse(training, needed)
    reductions = transform_lib.check_sparse_rows(transform, sparse_on_ps)

    report = StepReport(tf.cast(training.loss, tf.float64) / topo.size, topo.size, training.model.metrics)
    allreduce = AllReduceRoute(request, rebuilt, ar_entries)
    global_grads = allreduce.build(rider=report.local)
    extras = [make(request, rebuilt, plan.on_route(route)) for route, make in extra_routes.items()
              if plan.on_route(route)]
    for route in extras:
        global_grads.update(route.build())
    ps_route = PSRoute(request, rebuilt, ps_entries) if ps_entries else None
    if ps_route is not None:
        global_grads.update(ps_route.exchange())
        _read_step_before_pushing(global_step, needed, set(transform.depends), ps_route.pushes)
    own_rows = {p.variable.op.name: g.values for e in ps_entries for p, g in zip(rebuilt.parts[e.name],
                rebuilt.grads[e.name]) if isinstance(g, tf.IndexedSlices)}
    sums = transform_lib.sum_sparse_reductions(transform, reductions, own_rows, topo.size, needed)
    needed = ancestors(target)        # the routes and the sums above added to what the step needs
    transform = transform_lib.analyse(training, needed)
    chief_only = {op for op in needed if _writes_ps_variable(op)}
    gradient_ops = set(transform.depends)
    elsewhere = needed_without(target, chief_only, gradient_ops) - chief_only   # what ranks other than 0 run
    crossing = transform_lib.crossing_tensors(transform, on_ps, elsewhere) if ps_entries else []
    transform_lib.feed_global_gradients(transform, global_grads, needed)
    if ps_route is None:
        step = target
    elif topo.is_chief:
        transform_lib.place_next_to_variables(transform, {n: v.device for n, v in ps_parts.items()})
        step = ps_route.release(target, transform_lib.pack(crossing))
    else:
        token = ps_route.wait(sum(int(t.shape.num_elements()) for t, _ in crossing))
        transform_lib.unpack(crossing, token, elsewhere)
        step = [without(target, chief_only, gradient_ops, token.op)] + ps_route.pushes
    step = step if isinstance(step, list) else [step]
    if sums is not None:
        # A collective every rank must submit, needed there or not. As a session target, not
        # a control input: only used by control, grappler drops it and rank 0 waits forever.
        step = step + [sums.op]
    for route in extras:
        step = step + route.after_step(list(step))

    variables = tf.compat.v1.global_variables()
    on_server = [v for v in variables if "/job:ps" in v.device]
    local = [v for v in variables if "/job:ps" not in v.device]
    broadcast = None
    if topo.size > 1 and local:     # every copy starts as rank 0's (which may come from a checkpoint)
        import horovod.tensorflow as hvd
        broadcast = hvd.broadcast_variables(local, root_rank=0)
    byte_counts: Dict[str, tf.Tensor] = dict(allreduce.bytes)
    for route in [ps_route] + extras:
        if route is not None:
            byte_counts.update(route.bytes)
    summed = report.summed(allreduce.rider_sum)
    parts, optimizers = dict(rebuilt.parts), [(a.optimizer, [v for g, v in a.grads_and_vars if g is not None])
                                              for a in training.applies]
    working_copies, scheduled = set(), SyncStep.scheduled
    for route in extras:
        added = route.finish(broadcast)
        broadcast, scheduled = added.broadcast, added.scheduled
        parts.update(added.parts)
        working_copies |= added.working_copies
        optimizers.extend(added.optimizers)
    optimizers = [(o, [v for v in vs if v.name not in working_copies]) for o, vs in optimizers]
    step_spec = SyncStep(
        report=summed, report_routes=sorted(byte_counts), metric_names=report.metric_names,
        metric_sizes=report.metric_sizes,
        checkpoint_request=report.checkpoint_request,
        previous_bytes=report.previous_bytes, bytes_per_step=byte_counts,
        lower_bound_bytes=tf.add_n(allreduce.lower_bound + (ps_route.lower_bound if ps_route else [])
                                   + [b for route in extras for b in route.lower_bound] or [tf.constant(0, tf.int64)]),
        scheduled=scheduled)
    return DistributedGraph(
        graph=tf.compat.v1.get_default_graph(), loss=training.loss,
        train_op=step, global_step=global_step.read_value(), parts=parts,
        chief_init=[tf.compat.v1.variables_initializer(on_server)] if on_server else [],
        local_init=tf.group(tf.compat.v1.variables_initializer(local), tf.compat.v1.local_variables_initializer()),
        broadcast=broadcast, barrier=CollectiveBarrier(), runner=SyncRunner(training.loss, step, step_spec),
        optimizers=optimizers, working_copies=working_copies, layouts=detect_layouts(rebuilt, plan))


@dataclasses.dataclass
class RouteState:
    """What a further route adds to a synchronous graph once built."""
    broadcast: object                 # the start of every rank's copies (after the replicas' broadcast)
    parts: Dict[str, list]            # its variables' pieces: where their state is
    working_copies: set               # variables that are not state (the rank's local replicas)
    optimizers: List[tuple]           # (optimizer, variables) of its own
    scheduled: Callable[[int], tuple]  # SyncStep.scheduled


def _writes_ps_variable(op) -> bool:
    """An op that changes a variable on a parameter server: only rank 0 runs it."""
    return any(source.type in ("VarHandleOp", "VariableV2") and "/job:ps" in source.device
               for source in written_variables(op))


def _read_step_before_pushing(global_step, needed: set, gradient_ops: set, pushes) -> None:
    """The model's reads of the global step (LR schedules) happen before this rank pushes, so
    rank 0, which advances the step only once every push arrived, cannot advance it first.
    (A read that itself waits for the gradients or the applies is left alone: it cannot race.)"""
    reads = [op for op in global_step.handle.consumers() if op.type == "ReadVariableOp" and op in needed
             and not ancestors(op) & gradient_ops]
    for push in pushes:
        tf_shim.add_control_inputs(push, reads)


def detect_layouts(rebuilt, plan) -> Dict[str, str]:
    """How lookups map rows onto the shards of variables this toolkit partitioned.

    TF's embedding_lookup on a partitioned variable assigns id i to shard i % P ("mod", the
    compat.v1 default) or to contiguous ranges ("div"). Single-device equivalence needs the
    initial values split, and the final values merged, the same way the lookups read them."""
    layouts = {}
    for entry in plan.on_route(ROUTE_PS):
        if entry.user_partitioned or entry.partitions < 2:
            continue
        seen = set()
        for part in rebuilt.parts[entry.name]:
            for op in part.variable.handle.consumers():
                if op.type == "ResourceGather":
                    seen.add(_lookup_strategy(op))
        seen.discard(None)
        if len(seen) > 1:
            raise ModelError(f"variable {entry.name!r} is looked up with both 'mod' and 'div' partition "
                             "strategies; use one partition_strategy for every lookup of it, or "
                             "--partitions=1")
        layouts[entry.name] = seen.pop() if seen else "div"
    return layouts


def _lookup_strategy(gather_op):
    """'mod' or 'div' from the DynamicPartition that split the ids for this shard's gather."""
    source = gather_op.inputs[1].op
    while source.type in ("Identity", "Cast", "Reshape"):
        source = source.inputs[0].op
    if source.type != "DynamicPartition":
        return None
    assignment = source.inputs[1].op
    while assignment.type in ("Identity", "Cast"):
        assignment = assignment.inputs[0].op
    return "mod" if assignment.type == "FloorMod" else "div"
