"""Small models shared by the multi-rank jobs and the single-device reference in the tests.

Every case is deterministic in (rank, step) so the test can rebuild the global batch: the
concatenation, in rank order, of what each rank trained on."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

import parallax_tf as ptf

STEPS = 5
BATCH = 4
OPTIMIZERS = {
    "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1),
    "momentum": lambda: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9),
    "adagrad": lambda: tf.compat.v1.train.AdagradOptimizer(0.1),
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.01),
}
VOCAB, DIM, CLASSES, IDS_PER_EXAMPLE = 20, 4, 3, 3


def _embedding(name="emb", vocab=VOCAB, partitioner=None, dtype=tf.float32):
    return tf.compat.v1.get_variable(name, [vocab, DIM], dtype=dtype, partitioner=partitioner,
                                     initializer=tf.compat.v1.random_normal_initializer(seed=1))


def _dense_head(features, dtype=tf.float32):
    w = tf.compat.v1.get_variable("w", [DIM, CLASSES], dtype=dtype,
                                  initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
    b = tf.compat.v1.get_variable("b", [CLASSES], dtype=dtype, initializer=tf.compat.v1.zeros_initializer())
    return tf.nn.bias_add(tf.matmul(features, w), b)


def _classification_loss(logits):
    labels = tf.compat.v1.placeholder(tf.int64, [None], name="labels")
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def _ids():
    return tf.compat.v1.placeholder(tf.int64, [None, IDS_PER_EXAMPLE], name="ids")


def _dataset_batches(ctx):
    """This rank's batches from its own tf.data pipeline: no input_fn, nothing fed."""
    per_step = [batch("mixed", ctx.rank, step) for step in range(STEPS)]
    stacked = {k: np.stack([b[k] for b in per_step]) for k in per_step[0]}
    dataset = tf.data.Dataset.from_tensor_slices(stacked)
    return tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()


def build(model: str, optimizer: str):
    """model_fn(ctx) for a named case."""
    def model_fn(ctx=None):
        if model == "tfdata":
            feeds = _dataset_batches(ctx)
            features = tf.reduce_mean(tf.compat.v1.nn.embedding_lookup(_embedding(), feeds["ids"]), axis=1)
            labels = feeds["labels"]
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=labels, logits=_dense_head(features)))
        elif model == "ref_vars":          # non-resource (v1 "ref") variables
            emb = tf.compat.v1.get_variable("emb", [VOCAB, DIM], use_resource=False,
                                            initializer=tf.compat.v1.random_normal_initializer(seed=1))
            features = tf.reduce_mean(tf.compat.v1.nn.embedding_lookup(emb, _ids()), axis=1)
            w = tf.compat.v1.get_variable("w", [DIM, CLASSES], use_resource=False,
                                          initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
            b = tf.compat.v1.get_variable("b", [CLASSES], use_resource=False,
                                          initializer=tf.compat.v1.zeros_initializer())
            loss = _classification_loss(tf.nn.bias_add(tf.matmul(features, w), b))
        elif model in ("mixed", "duplicates", "auto_mod"):
            features = tf.reduce_mean(tf.compat.v1.nn.embedding_lookup(_embedding(), _ids()), axis=1)
            loss = _classification_loss(_dense_head(features))
        elif model == "auto_div":        # TF2 lookup: contiguous ("div") rows per shard
            features = tf.reduce_mean(tf.nn.embedding_lookup(_embedding(), _ids()), axis=1)
            loss = _classification_loss(_dense_head(features))
        elif model == "partitioned":     # the user partitioned the embedding themselves
            emb = _embedding(vocab=VOCAB + 1, partitioner=tf.compat.v1.fixed_size_partitioner(3))
            features = tf.reduce_mean(tf.compat.v1.nn.embedding_lookup(emb, _ids()), axis=1)
            loss = _classification_loss(_dense_head(features))
        elif model == "dense_only":      # float64, tf.Variable, no sparse gradient anywhere
            x = tf.compat.v1.placeholder(tf.float64, [None, DIM], name="x")
            w1 = tf.Variable(np.random.RandomState(3).randn(DIM, 5), name="w1")
            w2 = tf.Variable(np.random.RandomState(4).randn(5, CLASSES), name="w2")
            loss = _classification_loss(tf.matmul(tf.tanh(tf.matmul(x, w1)), w2))
        elif model == "sparse_only":     # nothing dense: the embedding is the whole model
            y = tf.compat.v1.placeholder(tf.float32, [None], name="y")
            rows = tf.compat.v1.nn.embedding_lookup(_embedding(), _ids())
            loss = tf.reduce_mean(tf.square(tf.reduce_sum(rows, axis=[1, 2]) - y))
        elif model == "rnn":             # embedding inside tf.while_loop control flow
            emb = _embedding()
            cell_w = tf.compat.v1.get_variable("cell_w", [2 * DIM, DIM],
                                               initializer=tf.compat.v1.glorot_uniform_initializer(seed=5))
            ids = _ids()
            inputs = tf.transpose(tf.compat.v1.nn.embedding_lookup(emb, ids), [1, 0, 2])

            def step(t, h):
                return t + 1, tf.tanh(tf.matmul(tf.concat([inputs[t], h], 1), cell_w))
            _, h = tf.while_loop(lambda t, h: t < IDS_PER_EXAMPLE, step,
                                 [tf.constant(0), tf.zeros_like(inputs[0])])
            loss = _classification_loss(_dense_head(h))
        else:
            raise ValueError(model)
        return ptf.Model(loss=loss, optimizer=OPTIMIZERS[optimizer]())
    return model_fn


def batch(model: str, rank: int, step: int) -> dict:
    model = "mixed" if model in ("tfdata", "ref_vars") else model
    rng = np.random.RandomState(1000 * step + rank)
    if model == "dense_only":
        return {"x": rng.randn(BATCH, DIM), "labels": rng.randint(0, CLASSES, BATCH)}
    high = 3 if model == "duplicates" else (VOCAB + 1 if model == "partitioned" else VOCAB)
    feeds = {"ids": rng.randint(0, high, [BATCH, IDS_PER_EXAMPLE])}
    if model == "sparse_only":
        feeds["y"] = rng.randn(BATCH).astype(np.float32)
    else:
        feeds["labels"] = rng.randint(0, CLASSES, BATCH)
    return feeds


def input_fn_for(model: str):
    if model == "tfdata":
        return None
    return lambda ctx: batch(model, ctx.rank, ctx.step)


def global_batch(model: str, step: int, size: int) -> dict:
    parts = [batch(model, r, step) for r in range(size)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


# (case name, model, optimizer, extra run options)
CASES = [(f"mixed_{opt}", "mixed", opt, {}) for opt in OPTIMIZERS] + [
    ("duplicates", "duplicates", "adagrad", {}),
    ("partitioned", "partitioned", "adagrad", {}),
    ("dense_only", "dense_only", "momentum", {}),
    ("sparse_only", "sparse_only", "adam", {}),
    ("rnn", "rnn", "sgd", {}),
    ("auto_mod", "auto_mod", "adagrad", {"partitions": 2}),
    ("auto_div", "auto_div", "momentum", {"partitions": 2}),
    ("no_local_aggregation", "mixed", "adagrad", {"local_aggregation": False}),
    ("tfdata", "tfdata", "momentum", {}),
    ("ref_vars", "ref_vars", "adagrad", {}),
]
CASE_BY_NAME = {c[0]: c for c in CASES}
