"""The smallest model, for tests: a tiny MLP regressing a fixed teacher, with an optional
small embedding so one variable has a sparse gradient (vocab=0 drops it).

    python -m models.mlp --steps 20
"""
from __future__ import annotations

import numpy as np
import parallax_tf as ptf  # before TF (keeps its import-time logs quiet); registers --steps, --np, ...
import tensorflow as tf
from absl import app, flags

from models import data, run_and_report

OPTIMIZERS = {
    "sgd": lambda lr: tf.compat.v1.train.GradientDescentOptimizer(lr),
    "momentum": lambda lr: tf.compat.v1.train.MomentumOptimizer(lr, 0.9),
    "adagrad": lambda lr: tf.compat.v1.train.AdagradOptimizer(lr),
    "adam": lambda lr: tf.compat.v1.train.AdamOptimizer(lr),
}

flags.DEFINE_integer("mlp_features", 4, "Dense input features.")
flags.DEFINE_integer("mlp_hidden", 8, "Hidden units (0: a linear model).")
flags.DEFINE_integer("mlp_depth", 1, "Hidden layers of --mlp_hidden units (deep enough to split into pipeline stages).")
flags.DEFINE_integer("mlp_vocab", 16, "Rows of the optional embedding (0: no embedding, no sparse variable).")
flags.DEFINE_integer("mlp_embed_dim", 4, "Embedding width.")
flags.DEFINE_integer("mlp_batch", 8, "Examples per rank per step.")
flags.DEFINE_float("mlp_label_noise", 0.0, "Standard deviation of Gaussian noise added to the targets: the "
                   "held-out loss (MSE) then has the floor label_noise**2, so runs can be compared at convergence.")
flags.DEFINE_enum("mlp_optimizer", "sgd", list(OPTIMIZERS), "v1 optimizer.")
flags.DEFINE_float("mlp_learning_rate", 0.1, "Learning rate.")
FLAGS = flags.FLAGS

DEFAULTS = dict(features=4, hidden=8, vocab=16, embed_dim=4, batch=8, optimizer="sgd", learning_rate=0.1, depth=1)


def make_model_fn(features: int = DEFAULTS["features"], hidden: int = DEFAULTS["hidden"],
                  vocab: int = DEFAULTS["vocab"], embed_dim: int = DEFAULTS["embed_dim"],
                  optimizer: str = DEFAULTS["optimizer"], learning_rate: float = DEFAULTS["learning_rate"],
                  depth: int = DEFAULTS["depth"]):
    """model_fn() with placeholders "features" float32 [batch, features], "labels" float32 [batch]
    and, when vocab > 0, "ids" int64 [batch]. Variables: embedding, hidden/{kernel,bias} (and
    hidden2, ... with depth > 1), out/{kernel,bias}."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")

    def model_fn():
        x = tf.compat.v1.placeholder(tf.float32, [None, features], name="features")
        labels = tf.compat.v1.placeholder(tf.float32, [None], name="labels")
        if vocab:
            ids = tf.compat.v1.placeholder(tf.int64, [None], name="ids")
            embedding = tf.compat.v1.get_variable(
                "embedding", [vocab, embed_dim], initializer=tf.compat.v1.random_normal_initializer(0, 0.1, seed=1))
            x = tf.concat([x, tf.nn.embedding_lookup(embedding, ids)], axis=1)
        layers = [("hidden" + (str(i + 1) if i else ""), hidden, tf.tanh) for i in range(depth)] if hidden else []
        for name, units, activation in layers + [("out", 1, None)]:
            with tf.compat.v1.variable_scope(name):
                kernel = tf.compat.v1.get_variable(
                    "kernel", [int(x.shape[-1]), units],
                    initializer=tf.compat.v1.glorot_uniform_initializer(seed=2 + 10 * (int(name[6:] or 1) - 1) if activation else 3))
                bias = tf.compat.v1.get_variable("bias", [units], initializer=tf.compat.v1.zeros_initializer())
                x = tf.nn.bias_add(tf.matmul(x, kernel), bias)
                x = activation(x) if activation else x
        loss = tf.reduce_mean(tf.square(tf.squeeze(x, axis=1) - labels))
        return ptf.Model(loss=loss, optimizer=OPTIMIZERS[optimizer](learning_rate))
    return model_fn


def make_input_fn(features: int = DEFAULTS["features"], vocab: int = DEFAULTS["vocab"],
                  batch: int = DEFAULTS["batch"], seed: int = 0, label_noise: float = 0.0):
    """input_fn(ctx) -> {"features", "labels"[, "ids"]}: labels from a fixed random linear teacher
    (plus a per-id offset when there is an embedding), so the loss can reach ~0; with label_noise
    (a standard deviation) Gaussian noise is added to the labels and the loss floor is its square."""
    teacher = np.random.RandomState(seed + 4242)
    weights = teacher.normal(size=features).astype(np.float32)
    offsets = teacher.normal(size=max(vocab, 1)).astype(np.float32)

    def input_fn(ctx):
        rng = data.batch_rng(seed, ctx.rank, ctx.step)
        x = rng.normal(size=(batch, features)).astype(np.float32)
        labels = 0.5 * np.tanh(x @ weights)
        batch_data = {"features": x}
        if vocab:
            ids = rng.randint(0, vocab, size=batch).astype(np.int64)
            labels = labels + 0.5 * offsets[ids]
            batch_data["ids"] = ids
        if label_noise:  # drawn last, so label_noise 0 keeps the streams of earlier runs
            labels = labels + label_noise * rng.normal(size=batch)
        batch_data["labels"] = labels.astype(np.float32)
        return batch_data
    return input_fn


model_fn = make_model_fn()
input_fn = make_input_fn()


def from_flags():
    """(model_fn, input_fn) with the sizes the --mlp_* flags give (their defaults: DEFAULTS)."""
    model = make_model_fn(features=FLAGS.mlp_features, hidden=FLAGS.mlp_hidden, vocab=FLAGS.mlp_vocab,
                          embed_dim=FLAGS.mlp_embed_dim, optimizer=FLAGS.mlp_optimizer,
                          learning_rate=FLAGS.mlp_learning_rate, depth=FLAGS.mlp_depth)
    inputs = make_input_fn(features=FLAGS.mlp_features, vocab=FLAGS.mlp_vocab, batch=FLAGS.mlp_batch,
                           seed=FLAGS.seed, label_noise=FLAGS.mlp_label_noise)
    return model, inputs


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    run_and_report("mlp", *from_flags())


if __name__ == "__main__":
    app.run(main)
