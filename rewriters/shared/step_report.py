"""What a synchronous step reports besides training: the loss over ranks, checkpoint requests
and the bytes each route moved; and how bytes are counted."""
from __future__ import annotations

from typing import Optional

import tensorflow as tf

INDEX_BYTES = 8    # an int64 id


class StepReport:
    """The one collective every step runs besides training: the sum over ranks of this rank's
    share of the step's loss (its loss / ranks in data parallelism), its checkpoint request and
    the bytes per route it moved in the *previous* step. Every rank learns the loss of the step
    (so all stop together on NaN), whether rank 0 wants a checkpoint after this step (all ranks
    take part in reading state averaged over ranks), and the cluster's bytes per route.

    The bytes are the previous step's, fed by the loop (`previous_bytes`), so the report needs
    nothing the step computes but the loss and can travel inside the dense gradients' own
    grouped allreduce (`local` -> AllReduceRoute.build(rider=...)): as a collective of its own it
    cost a Horovod cycle per step (lm, 2 hosts, 1 Gbit: 3,880 -> 4,730 examples/s riding).
    Byte counts cross as base-2^16 pieces, so a float32 sum stays exact up to 256 ranks."""

    def __init__(self, loss_share, size: int, metrics=None):
        """`metrics` ({name: scalar tensor}, Model.metrics) are averaged over ranks beside the loss."""
        self.size = size
        self.metric_names = sorted(metrics or {})
        self.metric_sizes = [max(1, int(metrics[name].shape.num_elements())) for name in self.metric_names]
        shares = [tf.reshape(tf.cast(metrics[name], tf.float64) / size, [-1]) for name in self.metric_names]
        self.checkpoint_request = tf.compat.v1.placeholder_with_default(tf.constant(0.0, tf.float64), [],
                                                                       name="parallax_ckpt_request")
        self.previous_bytes = tf.compat.v1.placeholder(tf.float64, [None], name="parallax_previous_bytes")
        count = tf.cast(tf.round(self.previous_bytes), tf.int64)
        pieces = tf.stack([count % 2 ** 16, count // 2 ** 16 % 2 ** 16, count // 2 ** 32])
        self.local = tf.concat([tf.stack([tf.cast(loss_share, tf.float64), self.checkpoint_request])] + shares +
                               [tf.reshape(tf.cast(pieces, tf.float64), [-1])], 0)

    def summed(self, ridden: Optional[tf.Tensor] = None) -> tf.Tensor:
        """[loss, checkpoint requests, metrics..., previous step's bytes per route], summed over ranks.
        `ridden`: `local` summed by another collective; None: one of its own.
        (The loss is never constant, so grappler cannot fold the allreduce away.)"""
        if ridden is None and self.size > 1:
            import horovod.tensorflow as hvd
            ridden = hvd.allreduce(self.local, op=hvd.Sum, name="parallax_step_report")
        total = tf.cast(ridden if ridden is not None else self.local, tf.float64)
        head = 2 + sum(self.metric_sizes)
        pieces = tf.reshape(tf.round(total[head:]), [3, -1])
        return tf.concat([total[:head], pieces[0] + pieces[1] * 2.0 ** 16 + pieces[2] * 2.0 ** 32], 0)


def tensor_bytes(t) -> tf.Tensor:
    """Bytes of a tensor or IndexedSlices, as an int64 scalar computed at run time."""
    if isinstance(t, tf.IndexedSlices):
        return tensor_bytes(t.values) + tensor_bytes(t.indices)
    return tf.cast(tf.size(t, out_type=tf.int64), tf.int64) * t.dtype.size


def lower_bound_bytes(grad, var, num_ranks: int, num_hosts: int, distinct_ids: bool = False) -> tf.Tensor:
    """The least one host's link must send for this variable per step, per rank: a sparse
    gradient's distinct rows pulled and pushed once and their ids sent once (the server can
    keep a pull's ids for the push), of which the (H-1)/H not served on the rank's own host
    cross a link (each host sends its ids, its pushes and the rows it serves); a dense one
    through ring AllReduce, 2(N-1)/N of its bytes. `distinct_ids`: the gradient's ids are
    already distinct (no tf.unique in every step)."""
    if isinstance(grad, tf.IndexedSlices):
        rows = tf.size(grad.indices if distinct_ids else tf.unique(grad.indices).y, out_type=tf.int64)
        row_bytes = var.dtype.base_dtype.size * max(1, int(tf.TensorShape(var.shape[1:]).num_elements() or 1))
        away = (num_hosts - 1) / num_hosts
        return tf.cast(tf.round(away * tf.cast(rows * (2 * row_bytes + INDEX_BYTES), tf.float64)), tf.int64)
    dense = var.dtype.base_dtype.size * int(var.shape.num_elements())
    return tf.constant(int(2 * (num_ranks - 1) / num_ranks * dense), tf.int64)
