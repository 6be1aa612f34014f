"""The compiled table shard (dynamic/compiled.py) against the standard-op one (dynamic/store.py),
step by step on the same ids: every read and every exported array equal to 1e-6."""
import numpy as np
import pytest
import tensorflow as tf

from parallax_tf.dynamic import ids as id_lib
from parallax_tf.dynamic.compiled import CompiledShard
from parallax_tf.dynamic.rules import rule_for
from parallax_tf.dynamic.store import Shard, TableOptions

OPTIMIZERS = {
    "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1),
    "momentum": lambda: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9),
    "nesterov": lambda: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9, use_nesterov=True),
    "adagrad": lambda: tf.compat.v1.train.AdagradOptimizer(0.2, initial_accumulator_value=0.3),
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.05),
    "ftrl": lambda: tf.compat.v1.train.FtrlOptimizer(0.3, l1_regularization_strength=0.001,
                                                     l2_regularization_strength=0.01),
    "ftrl_power": lambda: tf.compat.v1.train.FtrlOptimizer(0.3, learning_rate_power=-0.7,
                                                           l2_shrinkage_regularization_strength=0.02),
}
DIM, STEPS = 3, 6


def _run(shard_class, optimizer: str, admit_after: int, evict_after):
    graph = tf.Graph()
    with graph.as_default():
        options = TableOptions(dim=DIM, dtype=tf.float32, initializer=id_lib.uniform(0.5), seed=7,
                               admit_after=admit_after, evict_after_steps=evict_after)
        shard = shard_class("t", 0, None, options)
        rule = rule_for(OPTIMIZERS[optimizer]())
        shard.with_slots(rule.slots)          # the compiled shard holds its slots in the row's entry
        ids = tf.compat.v1.placeholder(tf.int64, [None])
        grads = tf.compat.v1.placeholder(tf.float32, [None, DIM])
        counts = tf.compat.v1.placeholder(tf.int64, [None])
        read = shard.read(ids)
        boundary = shard.boundary(ids, grads, counts, rule)
        exported = shard.export()
        rng = np.random.RandomState(3)
        seen = []
        with tf.compat.v1.Session(graph=graph) as sess:
            for _ in range(STEPS):
                step_ids = np.unique(rng.randint(0, 12, 5)).astype(np.int64)
                feed = {ids: step_ids, grads: rng.normal(size=(len(step_ids), DIM)).astype(np.float32),
                        counts: rng.randint(1, 3, len(step_ids))}
                seen.append(sess.run(read, {ids: np.arange(14, dtype=np.int64)}))
                sess.run(boundary, feed)
            seen.append(sess.run(read, {ids: np.arange(14, dtype=np.int64)}))
            arrays = sess.run(exported)
    return seen, _by_id(arrays, [s for s, _ in rule.slots])


def _by_id(arrays, slots):
    rows = np.argsort(arrays["ids"])
    tracked = np.argsort(arrays["seen_ids"])
    out = {k: arrays[k][rows] for k in ["ids", "values", *slots]}
    out.update({k: arrays[k][tracked] for k in ["seen_ids", "counts", "last_seen"]})
    out["clock"] = arrays["clock"]
    return out


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("admit_after, evict_after", [(1, None), (2, 2)])
def test_the_compiled_shard_trains_as_the_standard_one(optimizer, admit_after, evict_after):
    standard_reads, standard = _run(Shard, optimizer, admit_after, evict_after)
    compiled_reads, compiled = _run(CompiledShard, optimizer, admit_after, evict_after)
    for step, (want, got) in enumerate(zip(standard_reads, compiled_reads)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"read before boundary {step}")
    assert sorted(standard) == sorted(compiled)
    for key in standard:
        np.testing.assert_allclose(compiled[key], standard[key], rtol=1e-6, atol=1e-6, err_msg=key)
    assert len(standard["ids"]) > 3 and standard["clock"][0] == STEPS
