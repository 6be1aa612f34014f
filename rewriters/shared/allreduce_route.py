"""The AllReduce route: variables replicated on every rank, gradients averaged by Horovod
(dense tensors fused per plan group; IndexedSlices by allgather). Every rank then holds the
global gradient and runs the model's own transform and optimizer apply on it.

With `name`, every collective is named from it and the plan alone (not from the gradient
tensors' names), so ranks whose graphs differ still match (Stanza's FC nodes contribute zeros
to the conv nodes' sums); `summed` adds the contributions instead of averaging them."""
from __future__ import annotations

import tensorflow as tf

from parallax_tf.strategy import BuildRequest
from rewriters.shared.pipeline import SyncRoute
from rewriters.shared.rebuild import Rebuilt
from rewriters.shared.step_report import lower_bound_bytes, tensor_bytes


class AllReduceRoute(SyncRoute):
    def __init__(self, request: BuildRequest, rebuilt: Rebuilt, entries, name: str = None, summed: bool = False):
        self.request, self.rebuilt, self.entries = request, rebuilt, entries
        self.name, self.summed = name, summed
        self.bytes = {}
        self.lower_bound = []       # per variable: the least this rank must move for it
        self.rider_sum = None       # build(rider=...): the rider summed over ranks, if it found a group

    def build(self, rider: tf.Tensor = None) -> dict:
        """Variable op name -> the gradient averaged (or summed) over ranks. `rider`: a vector
        summed over ranks as one more tensor of the first float32/float64 group (into
        `rider_sum`), so it needs no collective of its own; left alone when there is none."""
        import horovod.tensorflow as hvd
        size = self.request.topology.size
        op = hvd.Sum if self.summed else hvd.Average
        groups, sparse = {}, []
        for entry in self.entries:
            for part, grad in zip(self.rebuilt.parts[entry.name], self.rebuilt.grads[entry.name]):
                if grad is None:
                    continue
                self.lower_bound.append(lower_bound_bytes(grad, part.variable, size,
                                                           len(self.request.topology.ranks_per_host)))
                if isinstance(grad, tf.IndexedSlices):
                    sparse.append((grad, part.variable))
                else:
                    groups.setdefault(entry.fusion_group or 0, []).append((grad, part.variable))
        averaged, dense_bytes, gathered_bytes = {}, [], []
        carrier = next((group for group in sorted(groups)
                        if {g.dtype for g, _ in groups[group]} in ({tf.float32}, {tf.float64})),
                       None) if size > 1 and rider is not None else None
        for group in sorted(groups):
            grads, variables = zip(*groups[group])
            name = f"{self.name}_group{group}" if self.name else None
            riding = []
            if group == carrier:    # averaging divides by the ranks: the rider is scaled up first
                riding = [tf.cast(rider * (1.0 if op == hvd.Sum else float(size)), grads[0].dtype)]
            reduced = hvd.grouped_allreduce(list(grads) + riding, op=op, name=name) if size > 1 else list(grads)
            if riding:
                self.rider_sum, reduced = reduced[-1], reduced[:-1]
            averaged.update({v.op.name: g for g, v in zip(reduced, variables)})
            dense_bytes.extend(tensor_bytes(g) for g in grads)
        for grad, var in sparse:
            averaged[var.op.name] = self._gathered(grad, var, size, op) if size > 1 else grad
            gathered_bytes.append(tensor_bytes(grad) * (size - 1))
        ring = 2.0 * (size - 1) / size
        self.bytes["allreduce"] = tf.cast(ring * tf.cast(_sum(dense_bytes), tf.float64), tf.int64)
        self.bytes["allgather"] = _sum(gathered_bytes)
        return averaged


    def _gathered(self, grad, var, size, op):
        import horovod.tensorflow as hvd
        if not self.name:
            return hvd.allreduce(grad, op=op)
        return gathered_rows(grad, size, f"{self.name}_{var.op.name.replace('/', '_')}", average=op == hvd.Average)


def gathered_rows(grad: tf.IndexedSlices, size: int, name: str, average: bool = True) -> tf.IndexedSlices:
    """Every rank's rows of a sparse gradient, repeated ids kept (averaged: each divided by the ranks)."""
    import horovod.tensorflow as hvd
    values = hvd.allgather(grad.values, name=f"{name}_values")
    indices = hvd.allgather(tf.cast(grad.indices, tf.int64), name=f"{name}_indices")
    return tf.IndexedSlices(values / size if average else values, indices, grad.dense_shape)


def _sum(values):
    return tf.add_n(values) if values else tf.constant(0, tf.int64)
