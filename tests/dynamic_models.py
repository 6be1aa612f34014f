"""A small model over a dynamic table, shared by tests/jobs/dynamic_job.py's ranks and the
single-process reference in tests/test_dynamic*.py. Batches are deterministic in (rank, step):
the global batch of a step is every rank's, in rank order."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

import parallax_tf as ptf
from parallax_tf import dynamic
from parallax_tf.dynamic.state import DynamicState

BATCH = 4
DIM = 3
FEATURES = 3
# ids from a huge range: a pool of 24, drawn with a skew so some repeat and some are rare
POOL = np.random.RandomState(7).randint(0, 2 ** 62, size=24, dtype=np.int64)
OPTIMIZERS = {
    "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.2),
    "momentum": lambda: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9),
    "adagrad": lambda: tf.compat.v1.train.AdagradOptimizer(0.3),
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.05),
    "ftrl": lambda: tf.compat.v1.train.FtrlOptimizer(0.3, l1_regularization_strength=0.001,
                                                     l2_regularization_strength=0.001),
}


def batch(rank: int, step: int, strings: bool = False):
    rng = np.random.RandomState(1000 * rank + step)
    picks = np.minimum(rng.geometric(0.15, size=(BATCH, FEATURES)) - 1, len(POOL) - 1)
    ids = POOL[picks]
    y = rng.randn(BATCH).astype(np.float32)
    if strings:
        return {"ids": np.array([[f"id{i}" for i in row] for row in picks]).astype(object), "y": y}
    return {"ids": ids, "y": y}


def global_batch(size: int, step: int, strings: bool = False):
    parts = [batch(r, step, strings) for r in range(size)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def model_fn(optimizer: str, strings: bool = False, twice: bool = False, mixed: bool = False, **table_options):
    """Model(loss, optimizer) over a dynamic table `emb` and one dense layer `dense`. `twice`:
    the table is read by two lookups (the first two features, then the third): the same model.
    `mixed`: the third feature reads a second table, `side`, whose law only standard ops compute
    (its shards end the step in standard ops beside `emb`'s compiled ones on the same servers)."""
    def build():
        ids = tf.compat.v1.placeholder(tf.string if strings else tf.int64, [None, FEATURES], name="ids")
        y = tf.compat.v1.placeholder(tf.float32, [None], name="y")
        table = dynamic.DynamicEmbedding("emb", DIM, **_table_options(table_options))
        if mixed:
            side = dynamic.DynamicEmbedding("side", DIM, initializer=dynamic.normal(0.2))
            rows = tf.concat([table.lookup(ids[:, :2]), side.lookup(ids[:, 2:])], 1)
        else:
            rows = table.lookup(ids) if not twice else \
                tf.concat([table.lookup(ids[:, :2]), table.lookup(ids[:, 2:])], 1)    # [batch, features, dim]
        dense = tf.compat.v1.get_variable("dense", initializer=tf.constant([[0.3], [-0.2], [0.1]]))
        pred = tf.reshape(tf.matmul(tf.reduce_sum(rows, 1), dense), [-1])
        loss = tf.reduce_mean(tf.square(pred - y))
        return ptf.Model(loss=loss, optimizer=OPTIMIZERS[optimizer](), predictions=pred)
    return build


def _table_options(options: dict) -> dict:
    """DynamicEmbedding's options as JSON gives them: {"normal": s} is the initializer
    dynamic.normal(s), a law only standard ops compute (its server's shards then push through
    accumulators and end the step in standard ops)."""
    options = dict(options)
    if "normal" in options:
        options["initializer"] = dynamic.normal(options.pop("normal"))
    return options


def exported_first_use():
    """What `python -m parallax_tf export --model tests.dynamic_models:exported_first_use` serves."""
    return model_fn("adagrad")


def exported_admit_evict():
    return model_fn("adagrad", admit_after=2, evict_after_steps=3)


def single_process(optimizer: str, size: int, steps: int, strings: bool = False, mixed: bool = False,
                   **table_options):
    """Plain TensorFlow in this process on the global batches: (losses, the tables' arrays,
    dense's value)."""
    graph = tf.Graph()
    with graph.as_default():
        model = model_fn(optimizer, strings, mixed=mixed, **table_options)()
        train = tf.group(model.optimizer.minimize(model.loss), dynamic.step(model.loss, model.optimizer))
        state = DynamicState(dynamic.tables(graph))
        ids, y = graph.get_tensor_by_name("ids:0"), graph.get_tensor_by_name("y:0")
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = []
            for step in range(steps):
                feed = global_batch(size, step, strings)
                losses.append(sess.run([model.loss, train], {ids: feed["ids"], y: feed["y"]})[0])
            arrays = state.read(sess)
            dense = sess.run([v for v in tf.compat.v1.global_variables() if v.op.name == "dense"][0])
    return np.array(losses), arrays, dense
