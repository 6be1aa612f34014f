"""The synchronous step's part for dynamic tables (parallax_tf.dynamic): every rank pushes, per
shard, the distinct ids its batch read with their gradients and occurrences into an accumulator
next to the shard; rank 0 takes every rank's push, sums them per id and runs the shard's step
boundary there (the optimizer's row rule, admission, eviction), then hands every other rank a
token. A rank reads its next batch's rows only after its token, so every rank reads the table
the last boundary left, and a dynamic table trains exactly as in one process."""
from __future__ import annotations

from typing import List

import tensorflow as tf

from parallax_tf.dynamic import table as table_lib
from rewriters.shared.step_report import tensor_bytes

NEVER_STALE = 2 ** 62     # every push's time step: see rewriters/shared/ps_route.py


class DynamicTablesStep:
    """Builds the pushes on every rank and, on rank 0, the boundaries and the tokens."""

    def __init__(self, request, rebuilt):
        self.topo = request.topology
        model_optimizer = table_lib.model_optimizer(rebuilt.training.applies)
        self.pushes: List[tf.Operation] = []
        self.boundaries: List[tf.Operation] = []
        self.counters = {}
        moved = []
        size = self.topo.size
        for rows in table_lib.step_rows(rebuilt.loss):
            rule, table = rows.table.rule(model_optimizer), rows.table
            parts = table_lib.partition(rows.ids, [rows.grads, rows.counts], len(table.shards))
            for shard in table.shards:      # every rank knows the slots: its results and checkpoints read them
                shard.with_slots(rule.slots)
            boundaries = []
            for shard, (ids, grads, counts) in zip(table.shards, parts):
                payload = tf.concat([grads, tf.cast(counts, grads.dtype)[:, None]], 1)
                accumulator = _accumulator(shard, table.dim + 1, grads.dtype)
                with tf.control_dependencies(rows.reads):
                    push = _push(accumulator, shard.device, ids, payload)
                self.pushes.append(push)
                if self._remote(shard.device):
                    moved += [tensor_bytes(payload), tensor_bytes(ids) * 2,
                              tensor_bytes(payload[:, :-1])]    # ids out twice, rows back, gradients out
                if not self.topo.is_chief:
                    continue
                with tf.device(shard.device), tf.control_dependencies([push]):
                    taken = accumulator.take_indexed_slices_grad(size)
                    taken.indices.set_shape([None])
                    taken.values.set_shape([None, table.dim + 1])
                    distinct, position = tf.unique(taken.indices, out_idx=tf.int32)
                    summed = tf.math.unsorted_segment_sum(taken.values, position, tf.size(distinct))
                    mean = summed[:, :-1] / tf.cast(size, summed.dtype)
                    occurrences = tf.cast(tf.round(summed[:, -1]), tf.int64)
                    boundaries.append(shard.boundary(distinct, mean, occurrences, rule))
            if self.topo.is_chief:
                ended = table.end_step(boundaries)
                self.boundaries.append(ended)
                with tf.control_dependencies([ended]):
                    counters = tf.add_n([shard.counters() for shard in table.shards])
                self.counters[table.name] = tf.gather(counters, [0, 2, 3])     # rows, admitted, evicted
        self.bytes = {"dynamic": tf.add_n(moved) if moved else tf.constant(0, tf.int64)}
        self.lower_bound: list = []

    @property
    def active(self) -> bool:
        return bool(self.pushes)

    def targets(self) -> list:
        """What this rank's step adds: rank 0, the boundaries and then every other rank's token;
        another rank, its pushes and the wait for its token."""
        topo = self.topo
        if topo.is_chief:
            with tf.control_dependencies(self.boundaries):
                released = [_token_queue(rank, topo).enqueue(tf.zeros([1], tf.float64)) for rank in range(1, topo.size)]
            return [tf.group(*self.boundaries, *released)]
        with tf.control_dependencies(self.pushes):
            token = _token_queue(topo.rank, topo).dequeue()
        return self.pushes + [token.op]

    def _remote(self, device: str) -> bool:
        return not (tf.DeviceSpec.from_string(device).task == self.topo.host and self.topo.local_rank == 0)


def _accumulator(shard, width: int, dtype):
    name = f"parallax_dynamic/{shard.name}/shard{shard.index}/grads"
    with tf.control_dependencies(None), tf.device(shard.device):
        return tf.compat.v1.SparseConditionalAccumulator(dtype, shape=tf.TensorShape([None, width]),
                                                         shared_name=name, name=name.replace("/", "_"),
                                                         reduction_type="SUM")


def _push(accumulator, device, ids, payload) -> tf.Operation:
    with tf.device(device):
        shape = tf.constant([-1, int(payload.shape[1])], tf.int64)
        return accumulator.apply_indexed_slices_grad(tf.IndexedSlices(payload, ids, shape),
                                                     local_step=tf.constant(NEVER_STALE, tf.int64))


def _token_queue(rank: int, topo):
    """Rank `rank`'s token queue on its host's server (one per rank: see ps_route._token_queue)."""
    with tf.control_dependencies(None), tf.device(f"/job:ps/task:{topo.host_of(rank)}"):
        return tf.queue.FIFOQueue(4, [tf.float64], shapes=[[1]], shared_name=f"parallax_dynamic_token_{rank}",
                                  name=f"parallax_dynamic_token_{rank}")
