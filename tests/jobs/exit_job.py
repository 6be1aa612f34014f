"""The TF1 tutorial's shape (a one-shot tf.data pipeline built inside model_fn, no input_fn),
trained --runs times in a row in one process, then the process exits. Every rank prints each
run's teardown time (from the end of training, through reading the results and leaving the
session, to run() returning): `teardown rank R run I: S`.

Closing a session destroys its tf.data iterator, which waits for tf.data's own threads: a rank
may leave its session seconds after its peers, by chance. --slow_last_close makes that certain
in the last run: rank 0's pipeline also holds a generator whose clean-up (run by that close)
waits until rank 1's server stops answering, or --slow_close_s. A rank that then sends anything
to a peer that has left waits for it forever."""
import os
import socket
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import parallax_tf as ptf  # noqa: E402  (before TensorFlow, as the README asks)
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

from parallax_tf.runtime.hooks import Hook  # noqa: E402

flags.DEFINE_integer("runs", 10, "ptf.run calls in a row")
flags.DEFINE_bool("slow_last_close", True, "rank 0 closes its last session only once rank 1 has left")
flags.DEFINE_float("slow_close_s", 6.0, "longest rank 0 waits for rank 1 to leave")
FLAGS = flags.FLAGS

_ARMED = {"now": False}      # set after the last run's training: only its session close waits


class _ArmAtEnd(Hook):
    def final(self, step, histograms):
        _ARMED["now"] = True


def _peer_server() -> str:
    from parallax_tf.runtime import cluster
    return cluster._CLUSTER.spec["worker"][1]


def _answers(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


def _held_open():
    """Endless zeros; closed by the session's close, which it keeps waiting while armed."""
    try:
        while True:
            yield np.float32(0.0)
    finally:
        if _ARMED["now"]:
            peer, until = _peer_server(), time.monotonic() + FLAGS.slow_close_s
            while _answers(peer) and time.monotonic() < until:
                time.sleep(0.1)


def model_fn(ctx):
    rng = np.random.RandomState(0)
    x = rng.rand(1024, 20).astype(np.float32)
    y = (x.sum(1) > 10).astype(np.int64)
    dataset = tf.compat.v1.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32)
    if ctx.rank == 0 and FLAGS.slow_last_close:
        held = tf.compat.v1.data.Dataset.from_generator(_held_open, output_signature=tf.TensorSpec([], tf.float32))
        dataset = tf.compat.v1.data.Dataset.zip((dataset, held.batch(32))).map(lambda xy, zero: xy)
    features, labels = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    hidden = tf.compat.v1.layers.dense(features, 16, activation=tf.nn.relu)
    logits = tf.compat.v1.layers.dense(hidden, 2)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    step = tf.compat.v1.train.get_or_create_global_step()
    rate = tf.compat.v1.train.exponential_decay(0.1, step, 100, 0.9)
    train_op = tf.compat.v1.train.GradientDescentOptimizer(rate).minimize(loss, global_step=step)
    return ptf.Model(loss=loss, train_op=train_op)


def main(argv):
    rank = os.environ.get("HOROVOD_RANK", "0")
    for run in range(FLAGS.runs):
        last = run == FLAGS.runs - 1
        result = ptf.run(model_fn, hooks=[_ArmAtEnd()] if last else [])
        teardown = time.time() - result.extras["phases"]["training"]
        print(f"teardown rank {rank} run {run}: {teardown:.2f}", flush=True)
    print(f"rank {rank} leaving at {time.time():.3f}", flush=True)


if __name__ == "__main__":
    app.run(main)
