"""Assembles a synchronous data-parallel graph from the PS and AllReduce routes around the
model's own train op.

Every rank builds the user's graph (train op included), takes its own raw gradients and sends
them along the routes; the train op's transform and applies are rewired to read the global
gradients (rewriters/shared/transform.py). AllReduce variables are then updated by every rank, PS
variables by rank 0 next to the variable. On the other ranks, every op that writes a PS
variable (its apply, the global-step increment) is rank 0's alone: what depended on it waits
for rank 0's token instead, which also carries what their transform needs from PS gradients.
Further routes (SyncRoute, rewriters/shared/pipeline.py) join through `assemble`'s factories.
"""
from __future__ import annotations

from typing import Dict, Sequence

import tensorflow as tf

from parallax_tf import routes as route_lib
from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.errors import ModelError
from parallax_tf.graph_walk import VALUE_PASS_THROUGH_OPS, VARIABLE_OPS, ancestors, feeding_op
from parallax_tf.plan import ROUTE_ALLREDUCE, ROUTE_ALLTOALL, ROUTE_LOCAL, ROUTE_PS
from parallax_tf.runtime.runner import SyncRunner, SyncStep
from parallax_tf.strategy import BuildRequest, DistributedGraph
from rewriters.shared.allreduce_route import AllReduceRoute
from rewriters.shared.dynamic_step import DynamicTablesStep
from rewriters.shared import alltoall_route  # noqa: F401  (gives the alltoall route its sync_route)
from rewriters.shared.ps_route import PSRoute
from rewriters.shared import transform as transform_lib
from rewriters.shared.pipeline import RouteFactory, applied_optimizers, check_routes, finish_graph, start_variables
from rewriters.shared.pruning import needed_without, without, written_variables
from rewriters.shared.rebuild import advancing_global_step, rebuild
from rewriters.shared.step_report import StepReport



def assemble(request: BuildRequest, allowed_routes: Sequence[str], strategy: str) -> DistributedGraph:
    """This rank's synchronous step over `allowed_routes`, stage by stage: PS and AllReduce, and
    any further route by the SyncRoute its registry entry builds (routes.Route.sync_route)."""
    extra_routes = {name: _sync_route(name) for name in allowed_routes if name not in (ROUTE_PS, ROUTE_ALLREDUCE)}
    check_routes(request.plan, [*allowed_routes, ROUTE_LOCAL], strategy)
    sync = _Assembly(request)              # the model rebuilt; its step advances the global step
    sync.route_gradients(extra_routes)     # every route's global gradients
    sync.feed_transform()                  # the model's transform and applies read them
    return sync.ending(sync.rank_step())   # rank 0's step or another rank's; the shared ending


def _sync_route(name: str) -> RouteFactory:
    factory = route_lib.get(name).sync_route
    if factory is None:
        raise ValueError(f"route {name!r} has no sync_route: the synchronous step cannot build it")
    return factory


class _Assembly:
    """The stages of `assemble`, in order; each leaves what the next one reads."""

    def __init__(self, request: BuildRequest):
        """Stage 1: the model rebuilt under the plan's placement, with this rank's own gradients."""
        plan, topo = request.plan, request.topology
        self.request, self.topo = request, topo
        self.rebuilt = rebuild(request, distinct_pulls=True)
        self.training = self.rebuilt.training
        self.rebuilt.require_a_gradient()
        self.ps_entries, self.ar_entries = plan.on_route(ROUTE_PS), plan.on_route(ROUTE_ALLREDUCE)
        self.target, self.global_step = advancing_global_step(
            self.training, "/job:ps/task:0" if self.ps_entries else topo.worker_device)
        self.ps_parts = {p.variable.op.name: p.variable for e in self.ps_entries for p in self.rebuilt.parts[e.name]}

    def route_gradients(self, extra_routes: Dict[str, RouteFactory]) -> None:
        """Stage 2: variable op name -> its global gradient, from every route (AllReduce, the
        further routes, PS, in that order), and the sums of sparse PS gradients' reductions."""
        request, rebuilt, topo, ps_entries = self.request, self.rebuilt, self.topo, self.ps_entries
        # sparse rows a rank sends away whole (PS, alltoall): a transform's reductions of them are summed
        rows_sent = [e for e in ps_entries + request.plan.on_route(ROUTE_ALLTOALL) if e.gradient == "sparse"]
        sparse_on_ps = {p.variable.op.name for e in rows_sent for p in rebuilt.parts[e.name]}
        needed = ancestors(self.target)
        transform = transform_lib.analyse(self.training, needed)
        reductions = transform_lib.check_sparse_rows(transform, sparse_on_ps)
        self.report = StepReport(tf.cast(self.training.loss, tf.float64) / topo.size, topo.size,
                                 self.training.model.metrics)
        self.allreduce = AllReduceRoute(request, rebuilt, self.ar_entries)
        self.global_grads = self.allreduce.build(rider=self.report.local)
        self.extras = [make(request, rebuilt, request.plan.on_route(route)) for route, make in extra_routes.items()
                       if request.plan.on_route(route)]
        for route in self.extras:
            self.global_grads.update(route.build())
        self.ps_route = PSRoute(request, rebuilt, ps_entries) if ps_entries else None
        if self.ps_route is not None:
            self.global_grads.update(self.ps_route.build())
            _read_step_before_pushing(self.global_step, needed, set(transform.depends), self.ps_route.pushes)
        self.dynamic = DynamicTablesStep(request, rebuilt)     # the dynamic tables' pushes and boundaries
        own_rows = {p.variable.op.name: g.values for e in rows_sent for p, g in zip(rebuilt.parts[e.name],
                    rebuilt.grads[e.name]) if isinstance(g, tf.IndexedSlices)}
        self.sums = transform_lib.sum_sparse_reductions(transform, reductions, own_rows, topo.size, needed)

    def feed_transform(self) -> None:
        """Stage 3: the model's transform reads the global gradients; what only rank 0 runs
        (writes of PS variables) and what crosses from it to the other ranks is known."""
        needed = ancestors(self.target)        # the routes and the sums above added to what the step needs
        self.transform = transform_lib.analyse(self.training, needed)
        self.chief_only = {op for op in needed if _writes_ps_variable(op)}
        self.gradient_ops = set(self.transform.depends)
        # what ranks other than 0 run
        self.elsewhere = needed_without(self.target, self.chief_only, self.gradient_ops) - self.chief_only
        on_ps = set(self.ps_parts)
        self.crossing = transform_lib.crossing_tensors(self.transform, on_ps, self.elsewhere) \
            if self.ps_entries else []
        transform_lib.feed_global_gradients(self.transform, self.global_grads, needed)

    def rank_step(self) -> list:
        """Stage 4: the step's targets on this rank: rank 0 updates the PS variables and releases
        the others, which wait for its token; then what the further routes add after the step."""
        ps_route = self.ps_route
        if ps_route is None:
            step = self.target
        elif self.topo.is_chief:
            transform_lib.place_next_to_variables(self.transform, {n: v.device for n, v in self.ps_parts.items()})
            step = ps_route.release(self.target, transform_lib.pack(self.crossing))
        else:
            token = ps_route.wait(sum(int(t.shape.num_elements()) for t, _ in self.crossing))
            transform_lib.unpack(self.crossing, token, self.elsewhere)
            step = [without(self.target, self.chief_only, self.gradient_ops, token.op)] + ps_route.pushes
        step = step if isinstance(step, list) else [step]
        if self.sums is not None:
            # A collective every rank must submit, needed there or not. As a session target, not
            # a control input: only used by control, grappler drops it and rank 0 waits forever.
            step = step + [self.sums.op]
        for route in self.extras:
            step = step + route.after_step(list(step))
        if self.dynamic.active:
            step = step + self.dynamic.targets()
        return step

    def ending(self, step: list) -> DistributedGraph:
        """Stage 5: the step report, the further routes' state after the replicas' broadcast,
        and the shared ending (rewriters/shared/pipeline.py)."""
        training, routes = self.training, [self.allreduce] + ([self.ps_route] if self.ps_route else []) + self.extras
        routes += [self.dynamic] if self.dynamic.active else []
        start = start_variables()
        start.keep_own([v for route in self.extras for v in route.kept_per_rank()])
        if self.topo.size > 1 and start.local:     # now: the further routes' own start follows it
            start.broadcast_local()
        byte_counts: Dict[str, tf.Tensor] = {}
        for route in routes:
            byte_counts.update(route.bytes)
        summed = self.report.summed(self.allreduce.rider_sum)
        parts, optimizers = dict(self.rebuilt.parts), applied_optimizers(training)
        working_copies, scheduled = set(), SyncStep.scheduled
        for route in self.extras:
            added = route.finish(start.broadcast)
            if added is None:
                continue
            start.broadcast, scheduled = added.broadcast, added.scheduled
            parts.update(added.parts)
            working_copies |= added.working_copies
            optimizers.extend(added.optimizers)
        report = self.report
        step_spec = SyncStep(
            report=summed, report_routes=sorted(byte_counts), metric_names=report.metric_names,
            metric_sizes=report.metric_sizes, checkpoint_request=report.checkpoint_request,
            previous_bytes=report.previous_bytes, bytes_per_step=byte_counts,
            lower_bound_bytes=tf.add_n([b for route in routes for b in route.lower_bound]
                                       or [tf.constant(0, tf.int64)]),
            scheduled=scheduled, tables=self.dynamic.counters)
        return finish_graph(start, loss=training.loss, train_op=step, global_step=self.global_step, parts=parts,
                            runner=SyncRunner(training.loss, step, step_spec), optimizers=optimizers,
                            working_copies=working_copies,
                            layouts={**detect_layouts(self.rebuilt, self.request.plan),
                                     **{k: v for route in self.extras for k, v in route.layouts().items()}})


def _writes_ps_variable(op) -> bool:
    """An op that changes a variable on a parameter server: only rank 0 runs it."""
    return any(source.type in VARIABLE_OPS and "/job:ps" in source.device
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
    source = feeding_op(gather_op.inputs[1], VALUE_PASS_THROUGH_OPS)
    if source.type != "DynamicPartition":
        return None
    assignment = feeding_op(source.inputs[1], VALUE_PASS_THROUGH_OPS)
    return "mod" if assignment.type == "FloorMod" else "div"
