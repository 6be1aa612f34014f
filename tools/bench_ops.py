"""The compiled ops against the best composition of stock TF ops doing the same.

    python -m tools.bench_ops [--case all|significance|round|stash] [--elements 10000000] [--repeats 5]
                              [--stash_pairs 2000]

Significance selection on a variable of --elements float32 values: core set by |w| + lambda|u|
and an explored set from the complement, sorted. Stock: tf.math.top_k for the core, a stateless
uniform draw masked on the core (tensor_scatter_nd_update) and top_k again for the explored set,
tf.sort for both. Prints milliseconds (median after a warm-up run) and the speed-up.

A Slim-DP round on the same variable (core 10%, explored 2%): the round's selection from a given
core set (ParallaxRoundSelection; stock: the masked stateless draw + top_k above, then concat and
tf.sort, and the route's former ParallaxExploreIndices + concat + tf.sort), and writing the
selected coordinates into a [rows, 1000] replica (ParallaxFlatScatterUpdate; stock:
UnravelIndex + Transpose + ResourceScatterNdUpdate, or read + tensor_scatter_nd_update + assign).

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
flags.DEFINE_enum("case", "all", ["all", "significance", "round", "stash"], "Which ops to benchmark.")
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
    """`target`: what to run, or (what to run, its feed)."""
    target, feed = target if isinstance(target, tuple) else (target, None)
    sess.run(target, feed)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        sess.run(target, feed)
        times.append(time.perf_counter() - began)
    return 1000 * float(np.median(times))


def main(argv):
    if FLAGS.case in ("all", "significance"):
        bench_significance()
    if FLAGS.case in ("all", "round"):
        bench_round()
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
    print_table(f"significance selection, {n:,} float32 elements", rows)


def print_table(title: str, rows) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    threads = tf.config.threading.get_intra_op_parallelism_threads() or "default"
    print(f"{title}, {threads} intra-op threads")
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def bench_round(core_fraction: float = 0.10, explore_fraction: float = 0.08):  # slim_dp defaults
    n = FLAGS.elements
    rng = np.random.RandomState(0)
    core_size, explore_size = int(core_fraction * n), int(explore_fraction * n)
    shape = [n // 1000, 1000]
    rows = [("step", "parallax op ms", "stock ops ms", "speed-up", "stock composition")]
    with tf.Graph().as_default():
        # variables, not constants: grappler would fold a selection of constants before timing
        core = tf.Variable(np.sort(rng.choice(n, core_size, replace=False)).astype(np.int32)).read_value()
        seed, round_index = tf.Variable(7, dtype=tf.int64).read_value(), tf.Variable(3, dtype=tf.int64).read_value()
        replica = tf.Variable(tf.zeros(shape), use_resource=True)
        selected = ops.round_selection(core, n, seed, round_index, explore_size)
        values = tf.random.stateless_uniform([core_size + explore_size], seed=[1, 2])
        draw = tf.random.stateless_uniform([n], seed=tf.stack([seed, round_index]))
        draw = tf.tensor_scatter_nd_update(draw, core[:, None], -tf.ones_like(core, tf.float32))
        stock_draw = tf.math.top_k(draw, explore_size, sorted=False).indices
        former = ops.explore_indices(core, n, seed, round_index, explore_size)
        scatter_nd = tf.raw_ops.ResourceScatterNdUpdate(
            ref=replica.handle, indices=tf.transpose(tf.unravel_index(selected, shape)), updates=values)
        copied = replica.assign(tf.reshape(tf.tensor_scatter_nd_update(
            tf.reshape(replica.read_value(), [-1]), selected[:, None], values), shape), read_value=False)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            fixed = sess.run({"selected": selected, "values": values})
            feed = {selected: fixed["selected"], values: fixed["values"]}     # scatters time the write only
            ours = median_ms(sess, tf.reduce_sum(selected), FLAGS.repeats)
            for name, other in (("draw + top_k + concat + sort", stock_draw), ("explore op + concat + sort", former)):
                theirs = median_ms(sess, tf.reduce_sum(tf.sort(tf.concat([core, other], 0))), FLAGS.repeats)
                rows.append(("selection", f"{ours:.1f}", f"{theirs:.1f}", f"{theirs / ours:.2f}x", name))
            ours = median_ms(sess, (ops.flat_scatter_update(replica, selected, values), feed), FLAGS.repeats)
            # the dense copy before scatter_nd: TF's scatter turns the replica copy-on-read, and
            # every later read of it would copy it whole
            for name, other in (("read + scatter + assign", copied), ("unravel + transpose + scatter_nd", scatter_nd)):
                theirs = median_ms(sess, (other, feed), FLAGS.repeats)
                rows.append(("write", f"{ours:.1f}", f"{theirs:.1f}", f"{theirs / ours:.2f}x", name))
    print_table(f"a Slim-DP round on {n:,} float32 elements (core {core_fraction:.0%}, explored "
                f"{explore_fraction:.0%}, replica {shape[0]}x{shape[1]})", rows)



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
