"""Runs on every rank: trains a model whose tf.data pipeline is built inside model_fn (no
input_fn), once sharded (the default) and once with shard_input=False, and saves what this rank
got into OUT_DIR/<mode>.rank<r>.npz.

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


def model_fn(batch: int = BATCH):
    """A single-device script's model: linear regression over its own tf.data pipeline."""
    ds = tf.compat.v1.data.Dataset.from_tensor_slices((FEATURES, TARGETS)).repeat().batch(batch)
    feats, labels = tf.compat.v1.data.make_one_shot_iterator(ds).get_next()
    w = tf.compat.v1.get_variable("w", initializer=INITIAL_W)
    b = tf.compat.v1.get_variable("b", [1], initializer=tf.compat.v1.zeros_initializer())
    loss = tf.reduce_mean(tf.square(tf.matmul(feats, w) + b - labels))
    return ptf.Model(loss=loss, optimizer=tf.compat.v1.train.MomentumOptimizer(0.1, 0.9))


def main(out_dir):
    import horovod.tensorflow as hvd
    for mode, shard in (("sharded", True), ("whole", False)):
        result = ptf.run(lambda: model_fn(), None, steps=STEPS, log_every=0, shard_input=shard)
        np.savez(os.path.join(out_dir, f"{mode}.rank{hvd.rank()}.npz"), losses=np.array(result.losses),
                 **{f"var:{k}": v for k, v in result.variables.items()})


if __name__ == "__main__":
    main(sys.argv[1])
