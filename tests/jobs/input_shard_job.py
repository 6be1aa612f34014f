"""Runs on every rank: trains a linear regression whose tf.data pipeline is built inside model_fn
(no input_fn), in each of the pipeline forms of PIPELINES, and saves what this rank got into
OUT_DIR/<form>.rank<r>.npz (the losses, the variables, the plan's decision for the pipeline).

usage: input_shard_job.py OUT_DIR"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import parallax_tf as ptf  # noqa: E402
import tensorflow as tf  # noqa: E402

STEPS, BATCH, DIM, ROWS = 3, 4, 3, 40
_RNG = np.random.RandomState(7)
FEATURES = _RNG.randn(ROWS, DIM).astype(np.float32)
TARGETS = _RNG.randn(ROWS, 1).astype(np.float32)
INITIAL_W = _RNG.randn(DIM, 1).astype(np.float32)


def rows_of_rank(form: str, rank: int, size: int) -> np.ndarray:
    """The rows a script that splits its data itself gives `rank`, in the order it reads them."""
    if form == "data_by_rank":
        return np.array_split(np.arange(ROWS), size)[rank]
    return np.arange(ROWS)[rank::size]          # shard_by_ctx


def _source(rows=None):
    rows = np.arange(ROWS) if rows is None else rows
    return tf.compat.v1.data.Dataset.from_tensor_slices((FEATURES[rows], TARGETS[rows]))


def _reinitializable(ds):
    """A table-registered iterator: Iterator.from_structure, its initializer in TABLE_INITIALIZERS."""
    iterator = tf.compat.v1.data.Iterator.from_structure(tf.compat.v1.data.get_output_types(ds),
                                                         tf.compat.v1.data.get_output_shapes(ds))
    tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.TABLE_INITIALIZERS, iterator.make_initializer(ds))
    return iterator


# form -> (the batches model_fn(ctx) reads, --shard_input)
PIPELINES = {
    # a pipeline that does not depend on the rank: sharded by the toolkit; and read whole
    "sharded": (lambda ctx, batch: tf.compat.v1.data.make_one_shot_iterator(
        _source().repeat().batch(batch)).get_next(), True),
    "whole": (lambda ctx, batch: tf.compat.v1.data.make_one_shot_iterator(
        _source().repeat().batch(batch)).get_next(), False),
    # scripts that split their data by rank themselves: left as built
    "shard_by_ctx": (lambda ctx, batch: tf.compat.v1.data.make_one_shot_iterator(
        _source().shard(ctx.size, ctx.rank).repeat().batch(batch)).get_next(), True),
    "data_by_rank": (lambda ctx, batch: tf.compat.v1.data.make_initializable_iterator(
        _source(rows_of_rank("data_by_rank", ctx.rank, ctx.size)).repeat().batch(batch)).get_next(), True),
    "shard_by_horovod": (lambda ctx, batch: _reinitializable(
        _source().shard(_horovod().size(), _horovod().rank()).repeat().batch(batch)).get_next(), True),
}


def _horovod():
    import horovod.tensorflow as hvd
    return hvd


def model_fn(ctx=None, batch: int = BATCH, form: str = "sharded"):
    """A single-device script's model: linear regression over its own tf.data pipeline."""
    feats, labels = PIPELINES[form][0](ctx, batch)
    w = tf.compat.v1.get_variable("w", initializer=INITIAL_W)
    b = tf.compat.v1.get_variable("b", [1], initializer=tf.compat.v1.zeros_initializer())
    loss = tf.reduce_mean(tf.square(tf.matmul(feats, w) + b - labels))
    return ptf.Model(loss=loss, optimizer=tf.compat.v1.train.MomentumOptimizer(0.1, 0.9))


def main(out_dir):
    for form, (_, shard) in PIPELINES.items():
        result = ptf.run(lambda ctx, form=form: model_fn(ctx, form=form), None, steps=STEPS, log_every=0,
                         shard_input=shard)
        decision = result.plan.inputs[0]
        np.savez(os.path.join(out_dir, f"{form}.rank{_horovod().rank()}.npz"), losses=np.array(result.losses),
                 sharded=decision.sharded, why=decision.why, **{f"var:{k}": v for k, v in result.variables.items()})


if __name__ == "__main__":
    main(sys.argv[1])
