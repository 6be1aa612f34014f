"""The parameter-server route: variables sharded over PS tasks, synchronous aggregation.

Per step every rank pushes its gradient (duplicates combined) into an accumulator next to the
variable; with local aggregation the ranks of one host first sum into an accumulator on their
own host's server and one of them pushes that sum. Rank 0 takes the sum once all have arrived;
the model's own transform and optimizer apply run on it next to the variable, rank 0 advances
the global step and hands every other rank a token; the others wait for their token, so nobody
reads a variable before it is updated.

Every tensor that crosses between tasks is a RecvTensor call of its own (a gRPC round trip, a
few segments each way, runtime CPU on both ends), so nothing crosses that need not: a rank's
lookups on one server share one message each way (rewriters/shared/ps_packing.py), a push reuses the
ids its lookup already sent, its shape and step are constants on the server, and a rank waits
for its token on its own worker rather than through every server.
"""
from __future__ import annotations

from typing import List

import tensorflow as tf

from parallax_tf.graph_walk import RESOURCE_READ_OPS, ancestors
from parallax_tf.strategy import BuildRequest
from rewriters.shared import ps_packing
from rewriters.shared.allreduce_route import gathered_rows
from rewriters.shared.pipeline import SyncRoute
from rewriters.shared.rebuild import Rebuilt
from rewriters.shared.step_report import lower_bound_bytes, tensor_bytes

# The time step every push carries. An accumulator drops a push older than its last take; none
# can be: a rank pushes step t+1 only after its token of step t, which rank 0 hands out after
# taking step t. Any step would do; a constant on the server saves sending the global step there.
NEVER_STALE = 2 ** 62


class PSRoute(SyncRoute):
    """A SyncRoute whose global gradients exist on rank 0 alone: the step adds `release` there
    and `wait` on the other ranks (rewriters/shared/sync.py)."""

    def __init__(self, request: BuildRequest, rebuilt: Rebuilt, entries):
        self.request, self.rebuilt, self.entries = request, rebuilt, entries
        self.topo = request.topology
        self.pushes: List[tf.Operation] = []
        self.packs: List[ps_packing.ServerPack] = []
        self.bytes = {}
        self.lower_bound = []       # per variable: the least this rank must move for it

    def build(self) -> dict:
        """Pushes this rank's gradients; on rank 0 returns variable op name -> the gradient
        averaged over ranks, taken next to the variable once every rank has pushed."""
        topo = self.topo
        local_agg = self.request.plan.local_aggregation and topo.local_size > 1
        num_required = len(self.topo.ranks_per_host) if local_agg else topo.size
        self.packs = ps_packing.pack_pulls(self.rebuilt.distinct_lookups, {
            p.variable.op.name: p.variable for e in self.entries for p in self.rebuilt.parts[e.name]})
        pack_of = {name: pack for pack in self.packs for name in pack.names} if not local_agg else {}
        pending, push_bytes, packed_pushes, each_row = [], [], {}, []
        for entry in self.entries:
            for part, grad in zip(self.rebuilt.parts[entry.name], self.rebuilt.grads[entry.name]):
                if grad is None:
                    continue
                var = part.variable
                if entry.params.get("rows") == "each" and isinstance(grad, tf.IndexedSlices):
                    each_row.append((grad, var))       # gathered to rank 0 below, repeated ids kept
                    continue
                grad = self._combined(var, grad)
                target = _accumulator(var, grad, var.op.name + "/parallax_grad", var.device)
                if var.op.name in pack_of:      # pushed below, with the rest of its server's
                    packed_pushes.setdefault(pack_of[var.op.name], []).append((target, grad, var))
                    continue
                push = self._push_own(target, grad, var, local_agg, push_bytes)
                pending.append((target, grad, var, push))
        for pack, members in packed_pushes.items():
            on_server = pack.push({var.op.name: grad.values for _, grad, var in members})
            if self.topo.crosses_processes(pack.device):
                push_bytes.extend(tensor_bytes(grad.values) for _, grad, _ in members)
            for target, grad, var in members:
                ids = pack.ids_on_server[pack.names.index(var.op.name)]
                push = _push(target, tf.IndexedSlices(on_server[var.op.name], ids), var, var.device)
                pending.append((target, grad, var, push))
        self.pushes = [push for _, _, _, push in pending]
        self.bytes["ps_pull"] = self._pull_bytes()
        gathered = self._gathered(each_row, push_bytes)
        # every rank takes part in the gathers: on the others they are step targets, as pushes are
        self.pushes += [part.op for grad in gathered.values() for part in (grad.values, grad.indices)]
        self.bytes["ps_push"] = tf.add_n(push_bytes) if push_bytes else tf.constant(0, tf.int64)
        if not topo.is_chief:
            return {}
        averaged = dict(gathered)
        for acc, grad, var, push in pending:
            # next to the variable, so the summed gradient never leaves its server; after this
            # rank's own push into that accumulator (a wait on every push would cross servers)
            with tf.device(var.device), tf.control_dependencies([push]):
                averaged[var.op.name] = _scale(_take(acc, grad, num_required), 1.0 / topo.size)
        return averaged

    def _gathered(self, each_row, push_bytes: list) -> dict:
        """Variable op name -> every rank's rows of its gradient, averaged, repeated ids kept
        (every rank takes part; rank 0 applies them next to the variable)."""
        found = {}
        with tf.device(self.topo.worker_device):
            for grad, var in each_row:
                self.lower_bound.append(lower_bound_bytes(grad, var, self.topo.size, len(self.topo.ranks_per_host)))
                push_bytes.append(tensor_bytes(grad) * (self.topo.size - 1))
                found[var.op.name] = gathered_rows(grad, self.topo.size, f"parallax_rows_{var.op.name.replace('/', '_')}") \
                    if self.topo.size > 1 else grad
        return found

    def _combined(self, var, grad):
        """This rank's gradient with one row per distinct id (on the worker); also counts its
        lower bound."""
        lookup = self.rebuilt.distinct_lookups.get(var.op.name)
        with tf.device(self.topo.worker_device):
            if lookup is not None:      # summed onto the ids the lookup sent to the server
                grad = tf.IndexedSlices(tf.math.unsorted_segment_sum(
                    grad.values, lookup.position, tf.size(lookup.ids, out_type=tf.int64)),
                    lookup.ids, grad.dense_shape)
            elif isinstance(grad, tf.IndexedSlices):
                grad = combine_duplicates(grad)
            self.lower_bound.append(lower_bound_bytes(grad, var, self.topo.size, len(self.topo.ranks_per_host),
                                                      distinct_ids=True))
        return grad

    def _push_own(self, target, grad, var, local_agg: bool, push_bytes: list) -> tf.Operation:
        """The push of one variable's gradient by itself (through the host's accumulator with
        local aggregation)."""
        topo = self.topo
        if not local_agg:
            if self.topo.crosses_processes(var.device):
                push_bytes.append(tensor_bytes(grad))
            return _push(target, grad, var, var.device)
        host_device = f"/job:ps/task:{topo.host}"
        host_acc = _accumulator(var, grad, f"{var.op.name}/parallax_grad_host{topo.host}", host_device)
        push = _push(host_acc, grad, var, host_device)
        if topo.local_rank != 0:    # the host's server lives in local rank 0's process
            push_bytes.append(tensor_bytes(grad))
            return push
        with tf.control_dependencies([push]):
            host_sum = _take(host_acc, grad, topo.local_size)
        if self.topo.crosses_processes(var.device):
            push_bytes.append(tensor_bytes(host_sum))
        return _push(target, host_sum, var, var.device)

    def release(self, chief_step: tf.Operation, payload: tf.Tensor) -> tf.Operation:
        """Rank 0, after its step (every PS variable updated): hands each other rank a token
        carrying `payload` (the few numbers their gradient transform needs from PS gradients)."""
        tokens = []
        with tf.control_dependencies([chief_step]):
            for rank in range(1, self.topo.size):
                queue = _token_queue(rank, payload.shape[0], self.topo)
                with tf.device(queue.queue_ref.device):
                    tokens.append(queue.enqueue(payload))
        return tf.group(chief_step, *tokens)

    def wait(self, payload_size: int) -> tf.Tensor:
        """Other ranks: rank 0's token for this step (its payload), on this rank's worker.
        Their pushes are step targets of their own: the token cannot come before them (rank 0
        takes every rank's push first), and a wait on them would cross from every server."""
        queue = _token_queue(self.topo.rank, payload_size, self.topo)
        with tf.device(queue.queue_ref.device):
            token = queue.dequeue()
        with tf.device(self.topo.worker_device):
            return tf.identity(token)

    def _pull_bytes(self) -> tf.Tensor:
        """Bytes of the forward's reads of PS variables served by another process (gathered rows,
        or whole dense values; a pack's ids too, whose pushes then count only their rows)."""
        needed = ancestors(self.rebuilt.loss.op)
        sizes = [pack.moved for pack in self.packs if self.topo.crosses_processes(pack.device)]
        packed = {name for pack in self.packs for name in pack.names}
        for entry in self.entries:
            for part in self.rebuilt.parts[entry.name]:
                if not self.topo.crosses_processes(part.variable.device) or part.variable.op.name in packed:
                    continue
                for op in part.variable.handle.consumers():
                    if op.type in RESOURCE_READ_OPS and op in needed:
                        sizes.append(tensor_bytes(op.outputs[0]))
        return tf.add_n(sizes) if sizes else tf.constant(0, tf.int64)


def combine_duplicates(grad: tf.IndexedSlices) -> tf.IndexedSlices:
    """Sums the rows of repeated ids so each id crosses the network once."""
    unique, position = tf.unique(grad.indices)
    values = tf.math.unsorted_segment_sum(grad.values, position, tf.size(unique))
    return tf.IndexedSlices(values, unique, grad.dense_shape)


def _accumulator(var, grad, shared_name, device):
    with tf.device(device):
        if isinstance(grad, tf.IndexedSlices):
            return tf.compat.v1.SparseConditionalAccumulator(
                var.dtype.base_dtype, shape=var.shape, shared_name=shared_name,
                name=shared_name.replace(":", "_"), reduction_type="SUM")
        return tf.compat.v1.ConditionalAccumulator(
            var.dtype.base_dtype, shape=var.shape, shared_name=shared_name,
            name=shared_name.replace(":", "_"), reduction_type="SUM")


def _push(acc, grad, var, device: str) -> tf.Operation:
    """`grad` of `var` into the accumulator on `device`; its step and shape are constants made there."""
    with tf.device(device):
        step = tf.constant(NEVER_STALE, tf.int64)
        if isinstance(grad, tf.IndexedSlices):
            shape = tf.constant(var.shape.as_list(), tf.int64)
            return acc.apply_indexed_slices_grad(tf.IndexedSlices(grad.values, grad.indices, shape), local_step=step)
        return acc.apply_grad(grad, local_step=step)


def _take(acc, like, num_required):
    if isinstance(like, tf.IndexedSlices):
        return acc.take_indexed_slices_grad(num_required)
    return acc.take_grad(num_required)


def _scale(grad, factor):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


def _token_queue(rank: int, payload_size: int, topo):
    """Rank `rank`'s own token queue, on its host's server (one queue per rank: a shared queue
    would let a fast rank take a slower rank's token and run a step ahead)."""
    host = topo.host_of(rank)
    with tf.device(f"/job:ps/task:{host}"):
        return tf.queue.FIFOQueue(4, [tf.float64], shapes=[[payload_size]], shared_name=f"parallax_token_{rank}",
                                  name=f"parallax_token_{rank}")
