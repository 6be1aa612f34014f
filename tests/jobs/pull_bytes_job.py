"""Runs on every rank: a lookup of an embedding on the PS with many repeated ids per batch
(DISTINCT ids, each repeated); saves this rank's bytes per route and the final values."""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import parallax_tf as ptf  # noqa: E402
import tensorflow as tf  # noqa: E402
from tools import link_counters  # noqa: E402

VOCAB, IDS, DISTINCT = 1000, 64, 4
DIM = int(os.environ.get("PULL_DIM", "16"))          # wide rows: the link counters see the pulls
STEPS = int(os.environ.get("PULL_STEPS", "3"))


def model_fn():
    ids = tf.compat.v1.placeholder(tf.int64, [None], name="ids")
    labels = tf.compat.v1.placeholder(tf.int64, [None], name="labels")
    emb = tf.compat.v1.get_variable("emb", [VOCAB, DIM], initializer=tf.compat.v1.random_normal_initializer(seed=1))
    w = tf.compat.v1.get_variable("w", [DIM, 3], initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
    logits = tf.matmul(tf.nn.embedding_lookup(emb, ids), w)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    return ptf.Model(loss=loss, optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))


def input_fn(ctx):
    rng = np.random.RandomState(100 * ctx.step + ctx.rank)
    chosen = rng.choice(VOCAB, DISTINCT, replace=False)
    return {"ids": chosen[np.arange(IDS) % DISTINCT], "labels": rng.randint(0, 3, IDS)}


if __name__ == "__main__":
    link = link_counters.LinkCounter(int(os.environ.get("HOROVOD_LOCAL_RANK", "0")))
    result = ptf.run(model_fn, input_fn, steps=STEPS, strategy="hybrid", log_every=0, hooks=[link])
    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump({"bytes": result.bytes_per_step, "routes": {v.name: v.route for v in result.plan.variables},
                   "link_bytes": link.moved, "steps": len(result.step_times)}, f)
