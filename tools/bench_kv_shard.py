"""What a compiled table shard's per-step bookkeeping costs as the table grows: the counters op
(read every step) and a boundary of a fixed number of ids with eviction on, on shards of
--rows live rows.

    python -m tools.bench_kv_shard --rows 10000,1000000 --step_ids 1000
"""
import time

import numpy as np
import tensorflow as tf
from absl import app, flags

from parallax_tf.dynamic import ids as id_lib
from parallax_tf.dynamic.compiled import CompiledShard
from parallax_tf.dynamic.rules import rule_for
from parallax_tf.dynamic.store import TableOptions

flags.DEFINE_list("rows", ["10000", "1000000"], "Live rows of the shard before timing.")
flags.DEFINE_integer("step_ids", 1000, "Distinct ids a timed boundary takes.")
flags.DEFINE_integer("repeats", 20, "Timed runs of each op.")
FLAGS = flags.FLAGS
DIM = 8


def _median_ms(sess, fetch, feeds) -> float:
    times = []
    for feed in feeds:
        begin = time.perf_counter()
        sess.run(fetch, feed)
        times.append(time.perf_counter() - begin)
    return 1e3 * float(np.median(times))


def measure(rows: int) -> tuple:
    """(counters ms, boundary ms) on a shard of `rows` live rows."""
    graph = tf.Graph()
    with graph.as_default():
        options = TableOptions(dim=DIM, dtype=tf.float32, initializer=id_lib.uniform(0.1), seed=1,
                               admit_after=1, evict_after_steps=10 ** 6)
        shard = CompiledShard("t", 0, None, options)
        rule = rule_for(tf.compat.v1.train.GradientDescentOptimizer(0.1))
        shard.with_slots(rule.slots)
        ids = tf.compat.v1.placeholder(tf.int64, [None])
        grads = tf.zeros([tf.size(ids), DIM])
        boundary = shard.boundary(ids, grads, tf.ones_like(ids), rule)
        counters = shard.counters()
        with tf.compat.v1.Session() as sess:
            for start in range(0, rows, 100000):
                sess.run(boundary, {ids: np.arange(start, min(rows, start + 100000), dtype=np.int64)})
            assert int(sess.run(counters)[0]) == rows
            rng = np.random.RandomState(0)
            steps = [{ids: np.unique(rng.randint(0, rows, FLAGS.step_ids)).astype(np.int64)}
                     for _ in range(FLAGS.repeats)]
            return _median_ms(sess, counters, [{}] * FLAGS.repeats), _median_ms(sess, boundary, steps)


def main(_):
    print(f"| live rows | counters ms | boundary of {FLAGS.step_ids} ids, eviction on, ms |")
    print("|---|---|---|")
    for rows in map(int, FLAGS.rows):
        counters_ms, boundary_ms = measure(rows)
        print(f"| {rows:,} | {counters_ms:.3f} | {boundary_ms:.3f} |")


if __name__ == "__main__":
    app.run(main)
