"""A tiny linear model trained slowly (input_fn sleeps --step_sleep_s per step) for many steps, so
that a test can kill a process of the job while its ranks train. Once a rank has trained
--ready_at steps it writes --out/training.rank<R>: one JSON object with its pid and the job's
temporary directories (the launcher's $PARALLAX_JOB_DIR and $PARALLAX_COMMIT_DIR)."""
import json
import os
import sys
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import parallax_tf as ptf  # noqa: E402  (before TensorFlow, as the README asks)
import tensorflow as tf  # noqa: E402

flags.DEFINE_string("out", None, "directory for the ranks' training.rank<R> files")
flags.DEFINE_float("step_sleep_s", 0.05, "input_fn's sleep per step")
flags.DEFINE_integer("ready_at", 3, "the step from which a rank says it is training")
FLAGS = flags.FLAGS


def model_fn():
    x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
    y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
    w = tf.compat.v1.get_variable("w", [4, 1])
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
    return ptf.Model(loss=loss, optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.01))


def input_fn(ctx):
    mark = os.path.join(FLAGS.out, f"training.rank{ctx.rank}")
    if ctx.step >= FLAGS.ready_at and not os.path.exists(mark):
        seen = {"pid": os.getpid(), "job_dir": os.environ.get("PARALLAX_JOB_DIR"),
                "commit_dir": os.environ.get("PARALLAX_COMMIT_DIR")}
        with open(mark + ".tmp", "w") as out:
            json.dump(seen, out)
        os.replace(mark + ".tmp", mark)
    time.sleep(FLAGS.step_sleep_s)
    rng = np.random.RandomState(ctx.step)
    x = rng.rand(8, 4).astype(np.float32)
    return {"x": x, "y": x.sum(1, keepdims=True)}


def main(_):
    ptf.run(model_fn, input_fn)


if __name__ == "__main__":
    app.run(main)
