"""The compiled ops against the best composition of stock TF ops doing the same.

    python -m tools.bench_ops [--case all|significance|stash] [--elements 10000000] [--repeats 5]
                              [--stash_pairs 2000]

Significance selection on a variable of --elements float32 values: core set by |w| + lambda|u|
and an explored set from the complement, sorted. Stock: tf.math.top_k for the core, a stateless
uniform draw masked on the core (tensor_scatter_nd_update) and top_k again for the explored set,
tf.sort for both. Prints milliseconds (median after a warm-up run) and the speed-up.

Input stash (DSP) on a [256, 4096] float32 stage input with staleness 4 (5 batches in flight):
one session.run stores batch b and takes batch b - 4, the steady state of a pipeline stage.
Stock: a tf.queue.FIFOQueue of (batch id, tensor) and tf.debugging.assert_equal on the dequeued
id (which, unlike ParallaxStashTake, has already removed the entry when the check fails). Prints
the median microseconds of a put+take pair, and of an empty session.run with the same feed."""
from __future__ import annotations

import time

import numpy as np
import tensorflow as tf
from absl import app, flags

from parallax_tf import ops

flags.DEFINE_integer("elements", 10_000_000, "Elements of the variable.")
flags.DEFINE_integer("repeats", 5, "Timed runs per case (median reported).")
flags.DEFINE_enum("case", "all", ["all", "significance", "stash"], "Which ops to benchmark.")
flags.DEFINE_integer("stash_pairs", 2000, "Timed put+take pairs per stash variant (median reported).")
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
    if FLAGS.case in ("all", "significance"):
        bench_significance()
    if FLAGS.case in ("all", "stash"):
        bench_stash()


def bench_significance():
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



STASH_SHAPE, STALENESS = (256, 4096), 4


def median_us(sess, variants, batch, pairs: int) -> list:
    """Median microseconds of one run of each variant's `pair` op (store batch b, take b - STALENESS,
    the steady state of a pipeline stage) after its `fill` op stored the first STALENESS batches.
    The variants take turns pair by pair, so drift in the machine's speed hits all alike."""
    for fill, _ in variants:
        for b in range(STALENESS):
            sess.run(fill, {batch: b})
    times = [[] for _ in variants]
    for b in range(STALENESS, STALENESS + pairs):
        for (_, pair), spent in zip(variants, times):
            began = time.perf_counter()
            sess.run(pair, {batch: b})
            spent.append(time.perf_counter() - began)
    return [1e6 * float(np.median(spent)) for spent in times]


def bench_stash():
    rng = np.random.RandomState(0)
    with tf.Graph().as_default():
        x = tf.Variable(rng.randn(*STASH_SHAPE).astype(np.float32))
        value = x.read_value()             # the variable's buffer, not a copy: time the stash only
        batch = tf.compat.v1.placeholder(tf.int64, [])

        handle = ops.input_stash([tf.float32], STALENESS + 1, 0, "bench_stash")
        put = ops.stash_put(handle, batch, [value])
        with tf.control_dependencies([put]):
            take = ops.stash_take(handle, batch - STALENESS, [value])[0].op

        queue = tf.queue.FIFOQueue(STALENESS + 1, [tf.int64, tf.float32], shapes=[[], list(STASH_SHAPE)])
        enqueue = queue.enqueue([batch, value])
        with tf.control_dependencies([enqueue]):
            got_batch, _ = queue.dequeue()
        checked = tf.debugging.assert_equal(got_batch, batch - STALENESS, message="wrong batch taken")

        names = ["parallax stash", "FIFOQueue + assert", "empty session.run"]
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            # the floor both sit on: a run reading the variable, with the same feed
            medians = median_us(sess, [(put, take), (enqueue, checked), (value.op, value.op)], batch,
                                FLAGS.stash_pairs)
            left = sess.run([ops.stash_size(handle), queue.size()])
            assert [int(v) for v in left] == [STALENESS, STALENESS], left   # both kept 4 in flight
    print(f"input stash, put+take of a {list(STASH_SHAPE)} float32 tensor, staleness {STALENESS} "
          f"({STALENESS + 1} in flight), median of {FLAGS.stash_pairs} pairs, variants interleaved")
    width = max(len(name) for name in names)
    for name, us in zip(names, medians):
        extra = f"  ({us - medians[-1]:+.1f} us over the empty run)" if name != names[-1] else ""
        print(f"{name.rjust(width)}  {us:8.1f} us{extra}")

if __name__ == "__main__":
    app.run(main)
