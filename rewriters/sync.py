"""Assembles a synchronous data-parallel graph from the PS and AllReduce routes."""
from __future__ import annotations

from typing import Dict, Sequence

import tensorflow as tf

from parallax_tf.errors import ModelError
from parallax_tf.plan import ROUTE_ALLREDUCE, ROUTE_PS
from rewriters.allreduce_route import AllReduceRoute
from rewriters.common import BuildRequest, DistributedGraph, barrier_op, rebuild
from rewriters.ps_route import PSRoute


def assemble(request: BuildRequest, allowed_routes: Sequence[str], strategy: str) -> DistributedGraph:
    plan, topo = request.plan, request.topology
    other = sorted({v.route for v in plan.variables} - set(allowed_routes))
    if other:
        raise ValueError(f"the {strategy} rewriter cannot build route(s) {other}")
    rebuilt = rebuild(request)
    if all(g is None for grads in rebuilt.grads.values() for g in grads):
        raise ModelError("no trainable variable gets a gradient from the loss: check that the loss "
                         "depends on the model's variables")
    ps_entries, ar_entries = plan.on_route(ROUTE_PS), plan.on_route(ROUTE_ALLREDUCE)
    step_device = "/job:ps/task:0" if ps_entries else topo.worker_device
    with tf.device(step_device):
        global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="parallax_global_step",
                                  use_resource=True)
    allreduce = AllReduceRoute(request, rebuilt, ar_entries, rebuilt.model.optimizer,
                               None if ps_entries else global_step)
    updates = [allreduce.build()]
    chief_init, local_init = [], [v.initializer for v in allreduce.replicas]
    ps_route = None
    if ps_entries:
        ps_route = PSRoute(request, rebuilt, ps_entries, rebuilt.model.optimizer, global_step)
        updates.append(ps_route.build())
        chief_init += [global_step.initializer] + ps_route.chief_init
    else:
        local_init.append(global_step.initializer)
    local_init.append(tf.compat.v1.variables_initializer(allreduce.local_state))
    # Everything each rank holds a copy of starts as rank 0's (which may come from a checkpoint).
    replicated = allreduce.replicas + allreduce.local_state + ([] if ps_entries else [global_step])
    broadcast = None
    if topo.size > 1 and replicated:
        import horovod.tensorflow as hvd
        broadcast = hvd.broadcast_variables(replicated, root_rank=0)
    byte_counts: Dict[str, tf.Tensor] = dict(allreduce.bytes)
    if ps_route is not None:
        byte_counts.update(ps_route.bytes)
    for name, layout in detect_layouts(rebuilt, plan).items():
        plan.by_name()[name].layout = layout
    loss = rebuilt.model.loss
    if topo.size > 1:
        import horovod.tensorflow as hvd
        mean_loss = hvd.allreduce(loss, op=hvd.Average, name="parallax_mean_loss")
    else:
        mean_loss = tf.identity(loss)
    return DistributedGraph(
        graph=tf.compat.v1.get_default_graph(), loss=loss, mean_loss=mean_loss, train_op=tf.group(*updates),
        global_step=global_step.read_value(), parts=rebuilt.parts, chief_init=chief_init,
        local_init=tf.group(*local_init), broadcast=broadcast, barrier=barrier_op("parallax_barrier"),
        bytes_per_step=byte_counts, global_step_var=global_step,
        lower_bound_bytes=tf.add_n(allreduce.lower_bound + (ps_route.lower_bound if ps_route else [])
                                   or [tf.constant(0, tf.int64)]),
        optimizers=[(allreduce.optimizer, allreduce.applied)]
        + ([(ps_route.optimizer, ps_route.applied)] if ps_route else []))


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
