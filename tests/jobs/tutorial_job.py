"""A TF1 tutorial as a new user ports it, in the README's own form (ptf.run at module level, no
absl app.run), starting as TF1 scripts do with disable_eager_execution() (TUTORIAL_DISABLE names
another of tf.compat.v1's switches, disable_v2_behavior): tf.compat.v1.layers, an exponential-decay learning rate on the global step, a
one-shot tf.data pipeline inside model_fn, an accuracy metric. Rank 0 prints what it got."""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import parallax_tf as ptf  # noqa: E402
import tensorflow as tf  # noqa: E402
getattr(tf.compat.v1, os.environ.get("TUTORIAL_DISABLE", "disable_eager_execution"))()

BATCH = 64


def model_fn(ctx):
    rng = np.random.RandomState(0)
    x = rng.rand(2048, 20).astype(np.float32)
    y = (x.sum(1) > 10).astype(np.int64)
    dataset = tf.compat.v1.data.Dataset.from_tensor_slices((x, y)).repeat().batch(BATCH)
    features, labels = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    hidden = tf.compat.v1.layers.dense(features, 16, activation=tf.nn.relu)
    logits = tf.compat.v1.layers.dense(hidden, 2)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), labels), tf.float32))
    step = tf.compat.v1.train.get_or_create_global_step()
    rate = tf.compat.v1.train.exponential_decay(0.1, step, 100, 0.9)
    train_op = tf.compat.v1.train.GradientDescentOptimizer(rate).minimize(loss, global_step=step)
    # this rank's number, whose mean over ranks the job must report
    rank = tf.cast(ctx.rank, tf.float32) + 0.0 * loss
    return ptf.Model(loss=loss, train_op=train_op, metrics={"accuracy": accuracy, "rank": rank})


result = ptf.run(model_fn, steps=int(os.environ.get("TUTORIAL_STEPS", "30")))
if result.plan_only:
    print("plan only")
elif result.variables and os.environ.get("HOROVOD_RANK", "0") == "0":
    print("result " + json.dumps({"examples_per_step": result.examples_per_step, "metrics": result.metrics,
                                  "mean_losses": result.mean_losses, "examples_per_s": result.examples_per_s,
                                  "steps": len(result.step_times)}), flush=True)
print("after run", flush=True)
