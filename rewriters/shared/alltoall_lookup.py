"""The alltoall route: a sparse variable row-sharded over the data ranks themselves, no parameter
server (the way Sparse Operation Kit and DeepRec move embeddings). Row i lives on rank i % N.

Per lookup and step, on every rank (all through Horovod, the engine of the dense AllReduce):
  forward   the lookup's distinct ids, grouped by owner, go to their owners (alltoall); each
            owner gathers their rows from its shard and sends them back (alltoall); the rank
            expands them to the lookup's shape, as single-device TF's gather returns them.
  backward  the gradient per looked-up id is summed per distinct id and sent back along the same
            exchange, values only (the owner kept the ids); the owner sums what every rank sent
            per row, divides by N (the average over ranks, as AllReduce does) and its optimizer
            applies those rows to its shard.
A rank thus moves each distinct id once and its row twice, of which 1/N stays on the rank: the
lower bound of a sparse gradient's traffic. The shard and its optimizer slots are the rank's own
state (never broadcast); values.StateIO scatters whole values into them and gathers them back.
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.errors import ModelError
from rewriters.shared.transform import rewire


def shard_rows(rows: int, num_ranks: int, rank: int) -> int:
    """Rows of a `rows`-row variable that rank `rank` of `num_ranks` holds (rows r, r+N, ...)."""
    return max(0, (rows - rank + num_ranks - 1) // num_ranks)


@dataclasses.dataclass
class Exchange:
    """One lookup's exchange in this step, kept for the gradient's way back."""
    ids: tf.Tensor          # the lookup's ids as the model gave them
    position: tf.Tensor     # per looked-up id, its index among the distinct ids
    num_distinct: tf.Tensor
    order: tf.Tensor        # the distinct ids grouped by owner: distinct[order]
    splits: tf.Tensor       # how many of them go to each rank (int32, [N])
    served: tf.Tensor       # the rows of this rank's shard other ranks asked for (local row index)
    away: tf.Tensor         # how many of the distinct ids another rank owns (int64)
    tag: str                # the collectives' name stem, the same on every rank


def exchange_lookups(variable, needed: set, num_ranks: int, rank: int) -> dict:
    """Rewires each lookup of the shard `variable` that the loss needs to the alltoall exchange.
    Returns new gather -> (the expansion, the lookup's ids, its Exchange), as
    rebuild.pull_distinct_rows returns its expansions (the gradient is taken per looked-up id)."""
    import horovod.tensorflow as hvd
    expansions = {}
    lookups = [op for op in variable.handle.consumers() if op in needed]
    other = [op for op in lookups if op.type != "ResourceGather" or op.get_attr("batch_dims") != 0]
    if other:
        raise ModelError(f"variable {variable.op.name!r} is read by {other[0].name!r} ({other[0].type}), not only "
                         "by lookups (tf.nn.embedding_lookup, tf.gather); the alltoall route serves lookups "
                         "alone. Use --strategy=hybrid (its PS route reads any way), or look its rows up")
    for k, op in enumerate(sorted(lookups, key=lambda o: o.name)):
        ids, looked_up = op.inputs[1], op.outputs[0]
        tag = f"parallax_a2a_{variable.op.name.replace('/', '_')}_{k}"
        distinct, position = tf.unique(tf.cast(tf.reshape(ids, [-1]), tf.int64))
        owner = tf.math.floormod(distinct, num_ranks)
        order = tf.argsort(owner, stable=True)
        splits = tf.math.bincount(tf.cast(owner, tf.int32), minlength=num_ranks, maxlength=num_ranks, dtype=tf.int32)
        asked, asked_splits = hvd.alltoall(tf.gather(distinct, order), splits=splits, name=f"{tag}_ids")
        served = tf.math.floordiv(asked, num_ranks)
        rows = tf_shim.resource_gather(variable.handle, served, dtype=looked_up.dtype, name=op.name + "_served")
        returned, _ = hvd.alltoall(rows, splits=asked_splits, name=f"{tag}_rows")
        distinct_rows = tf.gather(returned, tf.math.invert_permutation(order))
        expanded = tf.reshape(tf.gather(distinct_rows, position),
                              tf.concat([tf.shape(ids), tf.shape(rows)[1:]], 0))
        expanded.set_shape(looked_up.shape)
        rewire(looked_up, expanded, set(looked_up.consumers()))
        away = tf.reduce_sum(tf.cast(tf.not_equal(owner, rank), tf.int64))
        expansions[rows.op] = (expanded, ids, Exchange(ids, position, tf.size(distinct), order, splits, served,
                                                       away, tag))
    return expansions
