"""Collectives between ranks whose graphs differ (Stanza's conv and FC nodes): every one is a
global Horovod collective with an explicit name, and a rank with nothing to give takes part with
an empty tensor. No Horovod process sets: with dynamic ones every rank runs an extra global
negotiation each background cycle (mlp on 3 ranks: 1,766 -> 1,304 examples/s), and with any
non-global set a peer's death makes Horovod 0.28's shutdown throw inside its background thread
(std::terminate) instead of failing the pending ops, so the survivors could not say who was lost.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from rewriters.shared.step_report import tensor_bytes


def unfolded_zero() -> tf.Tensor:
    """0, from a stateful op. Horovod's collectives are not marked stateful, so TF's constant
    folding runs one whose inputs are all constants while it sets the graph up, on this rank
    alone, and the ranks deadlock; a collective with nothing real to send takes this."""
    return tf.cast(tf.timestamp() * 0.0, tf.int32)


def zeros(shape, dtype) -> tf.Tensor:
    return tf.zeros(shape, dtype) + tf.cast(unfolded_zero(), dtype)


def empty(per_row: Sequence[int], dtype) -> tf.Tensor:
    """A tensor of 0 rows of `per_row` each."""
    return tf.zeros(tf.concat([[unfolded_zero()], tf.constant(list(per_row), tf.int32)], 0), dtype)


def splits_to(to_rank: int, rows, size: int) -> tf.Tensor:
    """Alltoall splits sending `rows` rows to `to_rank` and none elsewhere."""
    return tf.one_hot(to_rank, size, dtype=tf.int32) * tf.cast(rows, tf.int32)


def nothing(size: int) -> tf.Tensor:
    return tf.zeros([size], tf.int32) + unfolded_zero()


def sum_among(specs: List[Tuple[list, tf.DType]], values: Optional[List[tf.Tensor]], ranks: List[int], size: int,
              name: str):
    """The sum over `ranks` of same-shaped tensors (`specs`: their shapes, one dtype), as a
    reduce-scatter then an allgather, each one global alltoall in which the other ranks send and
    receive nothing: each of `ranks` moves 2(F-1)/F of the bytes, as a ring AllReduce among them.
    Every rank of the job calls it with the same specs and name; ranks outside pass `values`
    None. Returns (the sums or None, the ops every rank must run, bytes this rank sends)."""
    import horovod.tensorflow as hvd
    dtype = specs[0][1]
    counts = [int(np.prod(shape)) for shape, _ in specs]
    chunk = -(-sum(counts) // len(ranks))
    splits = tf.constant([chunk if r in ranks else 0 for r in range(size)], tf.int32)
    if values is None:
        ops = [hvd.alltoall(empty([], dtype), splits=nothing(size), name=f"{name}_{step}")[0].op
               for step in ("scatter", "gather")]
        return None, ops, tf.constant(0, tf.int64)
    flat = tf.concat([tf.reshape(tf.cast(v, dtype), [-1]) for v in values], 0)
    flat = tf.pad(flat, [[0, chunk * len(ranks) - sum(counts)]])
    received, _ = hvd.alltoall(flat, splits=splits, name=f"{name}_scatter")      # my chunk from each of them
    mine = tf.reduce_sum(tf.reshape(received, [len(ranks), chunk]), 0)
    whole, _ = hvd.alltoall(tf.tile(mine, [len(ranks)]), splits=splits, name=f"{name}_gather")
    pieces = tf.split(whole[:sum(counts)], counts)
    sums = [tf.reshape(p, shape) for p, (shape, _) in zip(pieces, specs)]
    sent = 2 * (len(ranks) - 1) * tensor_bytes(mine)
    return sums, [whole.op], sent


def add(total, grad):
    """Two gradients of one variable summed (either may be None or IndexedSlices)."""
    if grad is None:
        return total
    if total is None:
        return grad
    if isinstance(total, tf.IndexedSlices) or isinstance(grad, tf.IndexedSlices):
        total, grad = (g if isinstance(g, tf.IndexedSlices) else _as_slices(g) for g in (total, grad))
        return tf.IndexedSlices(tf.concat([total.values, grad.values], 0),
                                tf.concat([tf.cast(total.indices, tf.int64), tf.cast(grad.indices, tf.int64)], 0),
                                total.dense_shape)
    return total + grad


def scale(grad, factor):
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


def _as_slices(dense):
    rows = tf.shape(dense, out_type=tf.int64)[0]
    return tf.IndexedSlices(dense, tf.range(rows), tf.shape(dense, out_type=tf.int64))
