"""The AllReduce route: variables replicated on every rank, gradients averaged by Horovod
(dense tensors fused per plan group; IndexedSlices by allgather). Every rank then holds the
global gradient and runs the model's own transform and optimizer apply on it."""
from __future__ import annotations

import tensorflow as tf

from rewriters.common import BuildRequest, Rebuilt, tensor_bytes
from rewriters.ps_route import lower_bound_bytes


class AllReduceRoute:
    def __init__(self, request: BuildRequest, rebuilt: Rebuilt, entries):
        self.request, self.rebuilt, self.entries = request, rebuilt, entries
        self.bytes = {}
        self.lower_bound = []       # per variable: the least this rank must move for it

    def build(self) -> dict:
        """Variable op name -> the gradient averaged over ranks."""
        import horovod.tensorflow as hvd
        size = self.request.topology.size
        groups, sparse = {}, []
        for entry in self.entries:
            for part, grad in zip(self.rebuilt.parts[entry.name], self.rebuilt.grads[entry.name]):
                if grad is None:
                    continue
                self.lower_bound.append(lower_bound_bytes(grad, part.variable, size))
                if isinstance(grad, tf.IndexedSlices):
                    sparse.append((grad, part.variable))
                else:
                    groups.setdefault(entry.fusion_group or 0, []).append((grad, part.variable))
        averaged, dense_bytes, gathered_bytes = {}, [], []
        for group in sorted(groups):
            grads, variables = zip(*groups[group])
            reduced = hvd.grouped_allreduce(list(grads), op=hvd.Average) if size > 1 else list(grads)
            averaged.update({v.op.name: g for g, v in zip(reduced, variables)})
            dense_bytes.extend(tensor_bytes(g) for g in grads)
        for grad, var in sparse:
            averaged[var.op.name] = hvd.allreduce(grad, op=hvd.Average) if size > 1 else grad
            gathered_bytes.append(tensor_bytes(grad) * (size - 1))
        ring = 2.0 * (size - 1) / size
        self.bytes["allreduce"] = tf.cast(ring * tf.cast(_sum(dense_bytes), tf.float64), tf.int64)
        self.bytes["allgather"] = _sum(gathered_bytes)
        return averaged


def _sum(values):
    return tf.add_n(values) if values else tf.constant(0, tf.int64)
