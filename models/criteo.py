"""A Criteo-shaped click model (DLRM): 13 integer and 26 categorical features.

Inputs, by placeholder name: "dense" float32 [batch, 13], Criteo's integer columns as counts
(a missing value is 0; the model takes log(1 + max(x, 0))); "C1".."C26" [batch], int64 ids
(row = id mod the table's rows) or strings such as Criteo's hex values (row = TF's
to_hash_bucket_fast: fixed hash buckets); "label" float32 [batch] (1.0 = click).

Model (DLRM): a bottom MLP (64-16) over the dense features; 26 embedding tables of width 16
(fixed hash buckets, or with --criteo_dynamic dynamic tables over the raw ids: ptf.DynamicEmbedding,
rows created as ids appear, --criteo_admit_after, --criteo_evict_after, --criteo_capacity);
the pairwise dot products of those 27 vectors (351 values) beside the bottom MLP's output; a
top MLP (64-32-1); sigmoid cross-entropy; Adagrad on every variable. Table rows: Criteo's
cardinalities (the Kaggle display-advertising data, as DLRM counts them), those above 1,000
scaled by --criteo_scale and kept at 1,000 or more.

Data:
- synthetic (the default): ids per feature Zipf-distributed over its table (so some rows are
  hot), counts geometric with 10% missing; a click is drawn with probability sigmoid(bias + a
  fixed hidden weight per (feature, id) + a linear term of the log counts), deterministic in
  (seed, rank, step);
- --criteo_data=FILE[,FILE...]: Criteo's own TSV (label, 13 integers, 26 hex strings; an
  empty field is a missing value) read by tf.data inside model_fn, which parallax_tf shards
  over the ranks. Missing integers read 0; a missing category is the hash of "" (a row of its
  own).

    python -m models.criteo --np 2 --steps 60
    python -m models.criteo --np 2 --criteo_data day_0.tsv --steps 1000
    python -m models.criteo --np 2 --criteo_dynamic --criteo_evict_after 1000 --steps 60
"""
from __future__ import annotations

import zlib
from typing import Optional, Sequence

import numpy as np
import parallax_tf as ptf  # before TF (keeps its import-time logs quiet); registers --steps, --np, ...
import tensorflow as tf
from absl import app, flags

from models import data, run_and_report
from models.cnn import dense

flags.DEFINE_float("criteo_scale", 1e-3, "Tables above 1,000 rows get this fraction of Criteo's cardinality "
                   "(at least 1,000 rows).", lower_bound=0.0)
flags.DEFINE_integer("criteo_batch", 128, "Examples per rank per step.", lower_bound=1)
flags.DEFINE_list("criteo_data", [], "Criteo TSV files to train on (label, 13 integers, 26 hex strings per line); "
                  "empty: the synthetic generator.")
flags.DEFINE_float("criteo_learning_rate", 0.05, "Adagrad learning rate.")
flags.DEFINE_bool("criteo_dynamic", False, "Dynamic tables (ptf.DynamicEmbedding) over the raw ids instead of fixed "
                  "hash buckets.")
flags.DEFINE_integer("criteo_admit_after", 1, "Dynamic tables: an id gets a row after this many occurrences.",
                     lower_bound=1)
flags.DEFINE_integer("criteo_evict_after", 0, "Dynamic tables: rows unseen for this many steps leave (0: never).",
                     lower_bound=0)
flags.DEFINE_integer("criteo_capacity", 0, "Dynamic tables: at most this many rows per table (0: no bound).",
                     lower_bound=0)
FLAGS = flags.FLAGS

# Criteo (Kaggle display advertising) categorical cardinalities, C1..C26
CARDINALITIES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
                 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
DENSE = 13
CATEGORICAL = tuple(f"C{i}" for i in range(1, len(CARDINALITIES) + 1))
WIDTH = 16
BOTTOM, TOP = (64, WIDTH), (64, 32)
DEFAULTS = dict(scale=1e-3, batch=128, learning_rate=0.05)
CLICK_BIAS, HIDDEN_SCALE, MISSING = -1.2, 0.35, 0.1


def table_rows(scale: float = DEFAULTS["scale"]) -> tuple:
    """Rows of each table: Criteo's cardinality, scaled (to at least 1,000) above 1,000."""
    return tuple(c if c <= 1000 else max(1000, int(round(c * scale))) for c in CARDINALITIES)


def _interactions(vectors):
    """The pairwise dot products (i < j) of [batch, n, width] vectors: [batch, n(n-1)/2]."""
    n = vectors.shape[1]
    dots = tf.reshape(tf.matmul(vectors, vectors, transpose_b=True), [-1, n * n])
    upper = [i * n + j for i in range(n) for j in range(i + 1, n)]
    return tf.gather(dots, upper, axis=1)


def logits(dense_counts, categorical: dict, rows: Sequence[int], dynamic: Optional[dict] = None):
    """DLRM over the inputs (see the module doc); creates the variables. `dynamic`: the dynamic
    tables' options (None: fixed tables of `rows` rows)."""
    x = tf.math.log1p(tf.maximum(dense_counts, 0.0))
    for index, units in enumerate(BOTTOM, start=1):
        x = dense(x, f"bottom{index}", units, seed=800 + index, relu=True)
    vectors = [x]
    for index, (name, count) in enumerate(zip(CATEGORICAL, rows)):
        value = categorical[name]
        if dynamic is not None:       # the raw id (a string's fingerprint), a row per id seen
            table = ptf.DynamicEmbedding(f"embedding/{name}", WIDTH, initializer=ptf.dynamic.uniform(0.05),
                                         seed=900 + index, **dynamic)
            vectors.append(table.lookup(value))
            continue
        row = (tf.strings.to_hash_bucket_fast(value, count) if value.dtype == tf.string
               else tf.math.floormod(value, count))
        table = tf.compat.v1.get_variable(f"embedding/{name}", [count, WIDTH], initializer=tf.compat.v1.
                                          random_uniform_initializer(-0.05, 0.05, seed=900 + index))
        vectors.append(tf.nn.embedding_lookup(table, row))
    x = tf.concat([x, _interactions(tf.stack(vectors, axis=1))], axis=1)
    for index, units in enumerate(TOP, start=1):
        x = dense(x, f"top{index}", units, seed=950 + index, relu=True)
    return tf.squeeze(dense(x, "click", 1, seed=999, relu=False), axis=1)


def _tsv_batches(files: Sequence[str], batch: int):
    """(dense counts, {C_i: hex strings}, labels) of Criteo's TSV lines, `batch` at a time, repeated."""
    defaults = [[0.0]] * (1 + DENSE) + [[""]] * len(CATEGORICAL)

    def parse(lines):
        fields = tf.io.decode_csv(lines, defaults, field_delim="\t", na_value="")
        return tf.stack(fields[1:1 + DENSE], axis=1), dict(zip(CATEGORICAL, fields[1 + DENSE:])), fields[0]
    dataset = tf.data.TextLineDataset(list(files)).batch(batch, drop_remainder=True).map(parse).repeat()
    return tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()


def make_model_fn(scale: float = DEFAULTS["scale"], learning_rate: float = DEFAULTS["learning_rate"],
                  files: Sequence[str] = (), batch: int = DEFAULTS["batch"], dynamic: Optional[dict] = None):
    """model_fn(ctx): placeholders (the synthetic input_fn, and serving), or `files`' TSV lines
    through tf.data (`batch` a step per rank); a served model takes Criteo's strings. `dynamic`:
    DynamicEmbedding's options for dynamic tables (None: fixed tables)."""
    rows = table_rows(scale)

    def model_fn(ctx):
        if files and not ctx.serving:
            dense_counts, categorical, label = _tsv_batches(files, batch)
        else:
            kind = tf.string if files else tf.int64
            dense_counts = tf.compat.v1.placeholder(tf.float32, [None, DENSE], name="dense")
            categorical = {name: tf.compat.v1.placeholder(kind, [None], name=name) for name in CATEGORICAL}
            label = tf.compat.v1.placeholder(tf.float32, [None], name="label")
        out = logits(dense_counts, categorical, rows, dynamic)
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=label, logits=out))
        return ptf.Model(loss=loss, optimizer=tf.compat.v1.train.AdagradOptimizer(learning_rate),
                         predictions={"probability": tf.sigmoid(out)})
    return model_fn


def hidden_weight(name: str, ids: np.ndarray, seed: int) -> np.ndarray:
    """The true effect of (feature, id) on the click logit: a hash of both, no table in memory."""
    salt = (zlib.crc32(name.encode()) + 7919 * seed) % 2**32
    mixed = (ids.astype(np.uint64) * np.uint64(2654435761) + np.uint64(salt)) % np.uint64(2**32)
    mixed = (mixed ^ (mixed >> np.uint64(15))) * np.uint64(2246822519) % np.uint64(2**32)
    return HIDDEN_SCALE * (2.0 * mixed.astype(np.float64) / 2**32 - 1.0)


def dense_weights(seed: int) -> np.ndarray:
    return np.random.RandomState(seed + 4242).normal(scale=0.3, size=DENSE)


def make_input_fn(scale: float = DEFAULTS["scale"], batch: int = DEFAULTS["batch"], seed: int = 0):
    """input_fn(ctx) -> "dense", "C1".."C26" (int64 ids) and "label", deterministic per (rank, step)."""
    rows = table_rows(scale)

    def input_fn(ctx):
        rng = data.batch_rng(seed, ctx.rank, ctx.step)
        counts = (rng.geometric(0.2, size=(batch, DENSE)) - 1).astype(np.float32)
        counts[rng.random_sample((batch, DENSE)) < MISSING] = 0.0
        logit = CLICK_BIAS + np.log1p(counts) @ dense_weights(seed)
        out = {"dense": counts}
        for name, count in zip(CATEGORICAL, rows):
            ids = np.minimum(np.searchsorted(data.zipf_cdf(count, 1.05), rng.random_sample(batch)), count - 1).astype(np.int64)
            logit += hidden_weight(name, ids, seed)
            out[name] = ids
        out["label"] = (rng.random_sample(batch) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return out
    return input_fn


model_fn = make_model_fn()
input_fn = make_input_fn()


def from_flags():
    """(model_fn, input_fn) with the --criteo_* flags; input_fn is None with --criteo_data (tf.data)."""
    dynamic = dict(admit_after=FLAGS.criteo_admit_after, evict_after_steps=FLAGS.criteo_evict_after or None,
                   capacity=FLAGS.criteo_capacity or None) if FLAGS.criteo_dynamic else None
    model = make_model_fn(FLAGS.criteo_scale, FLAGS.criteo_learning_rate, FLAGS.criteo_data, FLAGS.criteo_batch,
                          dynamic)
    inputs = None if FLAGS.criteo_data else make_input_fn(FLAGS.criteo_scale, FLAGS.criteo_batch, FLAGS.seed)
    return model, inputs


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    run_and_report("criteo", *from_flags())


if __name__ == "__main__":
    app.run(main)
