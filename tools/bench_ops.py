"""The compiled ops against the best composition of stock TF ops doing the same.

    python -m tools.bench_ops [--elements 10000000] [--repeats 5]

Significance selection on a variable of --elements float32 values: core set by |w| + lambda|u|
and an explored set from the complement, sorted. Stock: tf.math.top_k for the core, a stateless
uniform draw masked on the core (tensor_scatter_nd_update) and top_k again for the explored set,
tf.sort for both. Prints milliseconds (median after a warm-up run) and the speed-up."""
from __future__ import annotations

import time

import numpy as np
import tensorflow as tf
from absl import app, flags

from parallax_tf import ops

flags.DEFINE_integer("elements", 10_000_000, "Elements of the variable.")
flags.DEFINE_integer("repeats", 5, "Timed runs per case (median reported).")
FLAGS = flags.FLAGS


def stock_selection(weights, update, lam, seed, round_index, core_size, explore_size):
    score = tf.abs(weights) + lam * tf.abs(update)
    core = tf.sort(tf.math.top_k(score, core_size, sorted=False).indices)
    draw = tf.random.stateless_uniform(tf.shape(weights), seed=tf.stack([seed, round_index]))
    draw = tf.tensor_scatter_nd_update(draw, core[:, None], -tf.ones_like(core, tf.float32))
    explored = tf.sort(tf.math.top_k(draw, explore_size, sorted=False).indices)
    return core, explored


def median_ms(sess, target, repeats: int) -> float:
    sess.run(target)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        sess.run(target)
        times.append(time.perf_counter() - began)
    return 1000 * float(np.median(times))


def main(argv):
    n = FLAGS.elements
    rng = np.random.RandomState(0)
    rows = [("core", "explore", "parallax op ms", "stock ops ms", "speed-up")]
    with tf.Graph().as_default():
        weights = tf.Variable(rng.randn(n).astype(np.float32))
        update = tf.Variable(rng.randn(n).astype(np.float32))
        seed, round_index = tf.constant(7, tf.int64), tf.constant(3, tf.int64)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for core_fraction, explore_fraction in ((0.10, 0.01), (0.01, 0.01), (0.50, 0.01)):
                core_size, explore_size = int(core_fraction * n), int(explore_fraction * n)
                mine = ops.significance_select(weights, update, 1.0, seed, round_index, core_size, explore_size)
                stock = stock_selection(weights, update, 1.0, seed, round_index, core_size, explore_size)
                # a scalar of each result: time the computation, not copying indices into Python
                ours = median_ms(sess, [tf.reduce_sum(t) for t in mine], FLAGS.repeats)
                theirs = median_ms(sess, [tf.reduce_sum(t) for t in stock], FLAGS.repeats)
                rows.append((f"{core_fraction:.0%}", f"{explore_fraction:.0%}", f"{ours:.1f}", f"{theirs:.1f}",
                             f"{theirs / ours:.2f}x"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"significance selection, {n:,} float32 elements, {tf.config.threading.get_intra_op_parallelism_threads() or 'default'} intra-op threads")
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
    app.run(main)
