"""LSTM language model with a large vocabulary and sampled softmax (the sparse-heavy model).

Sparse: the input embedding [vocab, dim] (embedding_lookup) and the softmax weights/biases
(sampled_softmax_loss gathers only the true and sampled rows), so all three get IndexedSlices
gradients and the hybrid plan puts them on parameter servers. Dense: the LSTM kernel and bias.

    python -m models.lm --np 2 --steps 60
    python -m models.lm --plan_only
"""
from __future__ import annotations

import parallax_tf as ptf  # before TF (keeps its import-time logs quiet); registers --steps, --np, ...
import tensorflow as tf
from absl import app, flags

from models import data, run_and_report

flags.DEFINE_integer("lm_vocab", 50000, "Vocabulary size.")
flags.DEFINE_integer("lm_dim", 64, "Embedding width.")
flags.DEFINE_integer("lm_hidden", 64, "LSTM state width.")
flags.DEFINE_integer("lm_num_steps", 10, "Unrolled time steps per example.")
flags.DEFINE_integer("lm_batch", 32, "Sequences per rank per step.")
flags.DEFINE_integer("lm_num_sampled", 64, "Negative classes sampled per step by sampled softmax.")
flags.DEFINE_float("lm_learning_rate", 0.5, "Adagrad learning rate.")
FLAGS = flags.FLAGS

DEFAULTS = dict(vocab=50000, dim=64, hidden=64, num_steps=10, batch=32, num_sampled=64, learning_rate=0.5)


def lstm(inputs, hidden: int):
    """Unrolled LSTM over inputs [batch, time, dim] -> outputs [batch, time, hidden].

    Hand-written: tf.compat.v1.nn.rnn_cell.LSTMCell needs Keras 2 and is gone under Keras 3.
    A Python loop over the (short) time axis keeps the graph free of while loops, so every
    rewriter sees plain MatMuls on the kernel."""
    dim = int(inputs.shape[-1])
    kernel = tf.compat.v1.get_variable(
        "kernel", [dim + hidden, 4 * hidden],
        initializer=tf.compat.v1.glorot_uniform_initializer(seed=11))
    bias = tf.compat.v1.get_variable("bias", [4 * hidden], initializer=tf.compat.v1.zeros_initializer())
    batch = tf.shape(inputs)[0]
    c = tf.zeros(tf.stack([batch, hidden]))
    h = tf.zeros(tf.stack([batch, hidden]))
    outputs = []
    for x in tf.unstack(inputs, axis=1):
        gates = tf.nn.bias_add(tf.matmul(tf.concat([x, h], axis=1), kernel), bias)
        i, j, f, o = tf.split(gates, 4, axis=1)
        # forget-gate bias of 1 (as LSTMCell's forget_bias) so early gradients flow through time
        c = tf.sigmoid(f + 1.0) * c + tf.sigmoid(i) * tf.tanh(j)
        h = tf.sigmoid(o) * tf.tanh(c)
        outputs.append(h)
    return tf.stack(outputs, axis=1)


def make_model_fn(vocab: int = DEFAULTS["vocab"], dim: int = DEFAULTS["dim"], hidden: int = DEFAULTS["hidden"],
                  num_steps: int = DEFAULTS["num_steps"], num_sampled: int = DEFAULTS["num_sampled"],
                  learning_rate: float = DEFAULTS["learning_rate"]):
    """model_fn(ctx) building the LM; placeholders "ids" and "labels", both int64 [batch, num_steps]."""
    def model_fn(ctx):
        ids = tf.compat.v1.placeholder(tf.int64, [None, num_steps], name="ids")
        labels = tf.compat.v1.placeholder(tf.int64, [None, num_steps], name="labels")
        embedding = tf.compat.v1.get_variable(
            "embedding", [vocab, dim], initializer=tf.compat.v1.random_uniform_initializer(-0.1, 0.1, seed=7))
        with tf.compat.v1.variable_scope("lstm"):
            outputs = lstm(tf.compat.v1.nn.embedding_lookup(embedding, ids), hidden)
        softmax_w = tf.compat.v1.get_variable(
            "softmax_w", [vocab, hidden], initializer=tf.compat.v1.random_uniform_initializer(-0.1, 0.1, seed=13))
        softmax_b = tf.compat.v1.get_variable("softmax_b", [vocab], initializer=tf.compat.v1.zeros_initializer())
        # compat.v1 lookups read sharded tables "mod" (row i on shard i % P): a Zipf vocabulary's hot
        # rows then spread over every shard; "div" (tf.nn v2) would put them all on shard 0.
        # The sampler seed depends on the rank only, so every strategy draws the same negatives.
        losses = tf.compat.v1.nn.sampled_softmax_loss(
            weights=softmax_w, biases=softmax_b, labels=tf.reshape(labels, [-1, 1]),
            inputs=tf.reshape(outputs, [-1, hidden]), num_sampled=num_sampled, num_classes=vocab,
            seed=1 + ctx.rank)
        return ptf.Model(loss=tf.reduce_mean(losses),
                         optimizer=tf.compat.v1.train.AdagradOptimizer(learning_rate))
    return model_fn


def make_input_fn(vocab: int = DEFAULTS["vocab"], num_steps: int = DEFAULTS["num_steps"],
                  batch: int = DEFAULTS["batch"], seed: int = 0):
    """input_fn(ctx) -> {"ids", "labels"}: a Zipf token stream and its next tokens."""
    def input_fn(ctx):
        rng = data.batch_rng(seed, ctx.rank, ctx.step)
        tokens = data.zipf_token_rows(rng, batch, num_steps + 1, vocab)
        return {"ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    return input_fn


model_fn = make_model_fn()
input_fn = make_input_fn()


def from_flags():
    """(model_fn, input_fn) with the sizes the --lm_* flags give (their defaults: DEFAULTS)."""
    model = make_model_fn(vocab=FLAGS.lm_vocab, dim=FLAGS.lm_dim, hidden=FLAGS.lm_hidden,
                          num_steps=FLAGS.lm_num_steps, num_sampled=FLAGS.lm_num_sampled,
                          learning_rate=FLAGS.lm_learning_rate)
    inputs = make_input_fn(vocab=FLAGS.lm_vocab, num_steps=FLAGS.lm_num_steps, batch=FLAGS.lm_batch,
                           seed=FLAGS.seed)
    return model, inputs


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    run_and_report("lm", *from_flags())


if __name__ == "__main__":
    app.run(main)
