"""Wide & Deep click-through model on tf.compat.v1.feature_column (the recommendation model).

Nine categorical features, each a placeholder of its own name ([batch], int64 or string) read
through a features dict: hash-bucket columns (user_id, item_id, hour: int ids; publisher,
query, country: strings), vocabulary-list columns (category, device, weekday: strings, so
lookup tables are built and must be initialised) and one crossed column (device x category,
wide part only).

Wide: tf.compat.v1.feature_column.linear_model (usable in TF 2.21 graph mode) over every
categorical column, trained with FTRL. Deep: input_layer over embedding columns of widths 4, 8
and 16, then an MLP (64-32-1), trained with Adagrad, which advances the global step. Both
optimizers apply gradients of the one loss (sigmoid cross-entropy on wide + deep logits) in one
train op; every variable belongs to exactly one of them.

Sparse (IndexedSlices gradients, PS in the hybrid plan): every embedding table
(deep/input_layer/*_embedding/embedding_weights) and every per-column weight of the linear
model (wide/linear_model/*/weights, the crossed column's included). Dense: the linear model's
bias_weights and the MLP's kernels and biases. user_id's table (--recsys_user_buckets rows x 16,
6.1 MiB of the model's 7.3 MiB) is the large one: the cost model splits it (and the other hashed
tables) over the PS hosts when several hosts share a slow link (4 hosts at 10 Mbit, batch
1024); on one host every table stays in one shard unless --partitions asks for more.

Data: Zipf-distributed category ids per feature (so some rows are hot), a fixed hidden weight
per category; a click is drawn with probability sigmoid(bias + sum of the example's hidden
weights + a device x category term), deterministic in (seed, rank, step).

    python -m models.recsys --np 2 --steps 60
    python -m models.recsys --plan_only --np 2 --strategy hybrid --partitions 4
"""
from __future__ import annotations

import functools
import zlib
from typing import Sequence

import numpy as np
import parallax_tf as ptf  # before TF (keeps its import-time logs quiet); registers --steps, --np, ...
import tensorflow as tf
from absl import app, flags

from models import data, run_and_report
from models.cnn import dense

flags.DEFINE_integer("recsys_user_buckets", 100000, "Hash buckets of user_id (the large, sharded table).")
flags.DEFINE_integer("recsys_item_buckets", 10000, "Hash buckets of item_id.")
flags.DEFINE_integer("recsys_buckets", 1000, "Hash buckets of the other hashed features and of the cross.")
flags.DEFINE_list("recsys_hidden", ["64", "32"], "Widths of the deep part's hidden layers.")
flags.DEFINE_integer("recsys_batch", 64, "Examples per rank per step.")
flags.DEFINE_float("recsys_ftrl_rate", 0.3, "FTRL learning rate (wide part).")
flags.DEFINE_float("recsys_learning_rate", 0.1, "Adagrad learning rate (deep part).")
FLAGS = flags.FLAGS

DEFAULTS = dict(user_buckets=100000, item_buckets=10000, buckets=1000, hidden=(64, 32), batch=64,
                ftrl_rate=0.3, learning_rate=0.1)

VOCABULARIES = {
    "category": tuple(f"cat{i:02d}" for i in range(30)),
    "device": ("phone", "tablet", "desktop", "tv"),
    "weekday": ("mon", "tue", "wed", "thu", "fri", "sat", "sun"),
}
# name -> (dtype, hash buckets: a size key, or None for a vocabulary list, embedding width)
FEATURES = {
    "user_id": (tf.int64, "user_buckets", 16),
    "item_id": (tf.int64, "item_buckets", 16),
    "publisher": (tf.string, "buckets", 8),
    "query": (tf.string, "buckets", 8),
    "hour": (tf.int64, "buckets", 4),
    "category": (tf.string, None, 8),
    "device": (tf.string, None, 4),
    "weekday": (tf.string, None, 4),
    "country": (tf.string, "buckets", 8),
}
CROSS = ("device", "category")
CLICK_BIAS = -1.0      # a click rate well below one half, as in real click logs
HIDDEN_SCALE = 0.6     # std of a category's hidden weight: the logits spread over a few units


def columns(user_buckets: int, item_buckets: int, buckets: int):
    """(categorical columns for the wide part, embedding columns for the deep part)."""
    fc = tf.compat.v1.feature_column
    sizes = dict(user_buckets=user_buckets, item_buckets=item_buckets, buckets=buckets)
    categorical, embedded = [], []
    for index, (name, (dtype, size_key, width)) in enumerate(FEATURES.items()):
        if size_key is None:
            column = fc.categorical_column_with_vocabulary_list(name, VOCABULARIES[name])
        else:
            column = fc.categorical_column_with_hash_bucket(name, sizes[size_key], dtype=dtype)
        categorical.append(column)
        # explicit op seeds: the initial values do not depend on what else is in the graph
        embedded.append(fc.embedding_column(column, width, initializer=tf.compat.v1.truncated_normal_initializer(
            stddev=1.0 / np.sqrt(width), seed=500 + index)))
    categorical.append(fc.crossed_column(list(CROSS), buckets))
    return categorical, embedded


def make_model_fn(user_buckets: int = DEFAULTS["user_buckets"], item_buckets: int = DEFAULTS["item_buckets"],
                  buckets: int = DEFAULTS["buckets"], hidden: Sequence[int] = DEFAULTS["hidden"],
                  ftrl_rate: float = DEFAULTS["ftrl_rate"], learning_rate: float = DEFAULTS["learning_rate"]):
    """model_fn(ctx) building Wide & Deep; a placeholder per feature and "label" float32 [batch]."""
    def model_fn(ctx):
        features = {name: tf.compat.v1.placeholder(dtype, [None], name=name)
                    for name, (dtype, _, _) in FEATURES.items()}
        label = tf.compat.v1.placeholder(tf.float32, [None], name="label")
        categorical, embedded = columns(user_buckets, item_buckets, buckets)
        with tf.compat.v1.variable_scope("wide") as wide_scope:
            wide = tf.compat.v1.feature_column.linear_model(features, categorical)
        with tf.compat.v1.variable_scope("deep") as deep_scope:
            x = tf.compat.v1.feature_column.input_layer(features, embedded)
            for index, units in enumerate(hidden, start=1):
                x = dense(x, f"fc{index}", int(units), seed=600 + index, relu=True)
            deep = dense(x, "logit", 1, seed=699, relu=False)
        logits = tf.squeeze(wide + deep, axis=1)
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=label, logits=logits))
        trainable = tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES
        wide_vars = tf.compat.v1.get_collection(trainable, scope=wide_scope.name + "/")
        deep_vars = tf.compat.v1.get_collection(trainable, scope=deep_scope.name + "/")
        step = tf.compat.v1.train.get_or_create_global_step()
        ftrl = tf.compat.v1.train.FtrlOptimizer(ftrl_rate)
        adagrad = tf.compat.v1.train.AdagradOptimizer(learning_rate)
        train_op = tf.group(
            ftrl.apply_gradients(ftrl.compute_gradients(loss, var_list=wide_vars)),
            adagrad.apply_gradients(adagrad.compute_gradients(loss, var_list=deep_vars), global_step=step))
        return ptf.Model(loss=loss, train_op=train_op, predictions={"probability": tf.sigmoid(logits)})
    return model_fn


def cardinality(name: str, user_buckets: int, item_buckets: int, buckets: int) -> int:
    """How many distinct raw values a feature takes (hashed features: as many as buckets)."""
    if name in VOCABULARIES:
        return len(VOCABULARIES[name])
    if name == "hour":
        return 24
    return dict(user_id=user_buckets, item_id=item_buckets).get(name, buckets)


@functools.lru_cache(maxsize=32)
def hidden_weights(name: str, values: int, seed: int) -> np.ndarray:
    """The true per-category effect on the click logit; crc32, not hash(): equal in every process."""
    rng = np.random.RandomState((seed + zlib.crc32(name.encode())) % 2**32)
    return (HIDDEN_SCALE * rng.normal(size=values)).astype(np.float64)


def raw_values(name: str, ids: np.ndarray) -> np.ndarray:
    """What the placeholder is fed for category ids: the vocabulary's words, named strings, int ids."""
    if name in VOCABULARIES:
        return np.array([VOCABULARIES[name][i].encode() for i in ids], dtype=object)
    if FEATURES[name][0] == tf.string:
        return np.array([f"{name}{i}".encode() for i in ids], dtype=object)
    return ids.astype(np.int64)


def make_input_fn(user_buckets: int = DEFAULTS["user_buckets"], item_buckets: int = DEFAULTS["item_buckets"],
                  buckets: int = DEFAULTS["buckets"], batch: int = DEFAULTS["batch"], seed: int = 0):
    """input_fn(ctx) -> a batch per feature name plus "label" (1.0 = click)."""
    def input_fn(ctx):
        rng = data.batch_rng(seed, ctx.rank, ctx.step)
        out, logit, ids = {}, np.full(batch, CLICK_BIAS), {}
        for name in FEATURES:
            values = cardinality(name, user_buckets, item_buckets, buckets)
            ids[name] = np.minimum(np.searchsorted(data.zipf_cdf(values, 1.1), rng.random_sample(batch)), values - 1)
            logit += hidden_weights(name, values, seed)[ids[name]]
            out[name] = raw_values(name, ids[name])
        cross = hidden_weights("x".join(CROSS), len(VOCABULARIES[CROSS[0]]) * len(VOCABULARIES[CROSS[1]]), seed)
        logit += cross[ids[CROSS[0]] * len(VOCABULARIES[CROSS[1]]) + ids[CROSS[1]]]
        out["label"] = (rng.random_sample(batch) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return out
    return input_fn


model_fn = make_model_fn()
input_fn = make_input_fn()


def from_flags():
    """(model_fn, input_fn) with the sizes the --recsys_* flags give (their defaults: DEFAULTS)."""
    sizes = dict(user_buckets=FLAGS.recsys_user_buckets, item_buckets=FLAGS.recsys_item_buckets,
                 buckets=FLAGS.recsys_buckets)
    model = make_model_fn(hidden=[int(u) for u in FLAGS.recsys_hidden], ftrl_rate=FLAGS.recsys_ftrl_rate,
                          learning_rate=FLAGS.recsys_learning_rate, **sizes)
    inputs = make_input_fn(batch=FLAGS.recsys_batch, seed=FLAGS.seed, **sizes)
    return model, inputs


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    run_and_report("recsys", *from_flags())


if __name__ == "__main__":
    app.run(main)
