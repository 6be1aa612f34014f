"""The reference models in TF2: models/lm.py and models/recsys.py written as a TF2 user writes
them (tf.Variables, a loss function, tf_keras' legacy optimizers, which run the fused sparse
kernels the tf.compat.v1 ones do). tools.bench trains them two ways: as ptf.run(train_step,
dataset) (`--tf2_form`: `step_and_dataset`) and under TF's MultiWorkerMirroredStrategy
(tools/baselines_mwms.py). The same variables, shapes, initialisers, losses, optimizers and
learning rates as the model_fn forms, at the sizes their flags give (--lm_*, --recsys_*).

recsys' feature columns become what they compute: `to_hash_bucket_fast` of the value (ints as
strings), vocabulary lookups, a hashed cross, one embedding row per feature; as a TF2 step reads
them, the lookups run in the dataset's map (`WideDeep.ids`), the model on the ids."""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from absl import flags

from models import recsys
from parallax_tf.model import RunContext

FLAGS = flags.FLAGS


def sizes_from_flags(name: str) -> dict:
    if name == "lm":
        return dict(vocab=FLAGS.lm_vocab, dim=FLAGS.lm_dim, hidden=FLAGS.lm_hidden, num_steps=FLAGS.lm_num_steps,
                    num_sampled=FLAGS.lm_num_sampled, learning_rate=FLAGS.lm_learning_rate)
    if name == "recsys":
        return dict(user_buckets=FLAGS.recsys_user_buckets, item_buckets=FLAGS.recsys_item_buckets,
                    buckets=FLAGS.recsys_buckets, hidden=[int(u) for u in FLAGS.recsys_hidden],
                    ftrl_rate=FLAGS.recsys_ftrl_rate, learning_rate=FLAGS.recsys_learning_rate)
    raise ValueError(f"tf_mwms trains the lm and recsys models, not {name!r}")


def build(name: str, sizes: dict, rank: int = 0, ranks: int = 1):
    """The TF2 model (inside the strategy's scope, so its variables are mirrored)."""
    return (LanguageModel if name == "lm" else WideDeep)(rank=rank, ranks=ranks, **sizes)


def _legacy_optimizers():
    import tf_keras
    return tf_keras.optimizers.legacy


def _uniform(shape, seed, limit):
    return tf.random.stateless_uniform(shape, seed=(seed, 0), minval=-limit, maxval=limit)


class LanguageModel:
    """models/lm.py in TF2: embedding, a hand-unrolled LSTM, sampled softmax, Adagrad."""

    def __init__(self, vocab, dim, hidden, num_steps, num_sampled, learning_rate, rank=0, ranks=1):
        self.hidden, self.num_steps, self.num_sampled, self.vocab = hidden, num_steps, num_sampled, vocab
        self.rank, self.ranks = rank, ranks
        self.embedding = tf.Variable(_uniform([vocab, dim], 7, 0.1), name="embedding")
        glorot = np.sqrt(6.0 / (dim + hidden + 4 * hidden))
        self.kernel = tf.Variable(_uniform([dim + hidden, 4 * hidden], 11, glorot), name="lstm/kernel")
        self.bias = tf.Variable(tf.zeros([4 * hidden]), name="lstm/bias")
        self.softmax_w = tf.Variable(_uniform([vocab, hidden], 13, 0.1), name="softmax_w")
        self.softmax_b = tf.Variable(tf.zeros([vocab]), name="softmax_b")
        self.variables = [self.embedding, self.kernel, self.bias, self.softmax_w, self.softmax_b]
        self.optimizers = [(_legacy_optimizers().Adagrad(learning_rate), range(5))]

    def global_rows(self, batch):
        return tf.size(batch["labels"]) * self.ranks

    def losses(self, batch):
        inputs = tf.nn.embedding_lookup(self.embedding, batch["ids"])
        c = h = tf.zeros([tf.shape(inputs)[0], self.hidden])
        outputs = []
        for x in tf.unstack(inputs, num=self.num_steps, axis=1):
            gates = tf.nn.bias_add(tf.matmul(tf.concat([x, h], axis=1), self.kernel), self.bias)
            i, j, f, o = tf.split(gates, 4, axis=1)
            c = tf.sigmoid(f + 1.0) * c + tf.sigmoid(i) * tf.tanh(j)
            h = tf.sigmoid(o) * tf.tanh(c)
            outputs.append(h)
        # the reference's sampler seed: one per rank, so the same negatives as the other runs draw
        return tf.nn.sampled_softmax_loss(
            self.softmax_w, self.softmax_b, tf.reshape(batch["labels"], [-1, 1]),
            tf.reshape(tf.stack(outputs, axis=1), [-1, self.hidden]), self.num_sampled, self.vocab,
            seed=1 + self.rank)


class WideDeep:
    """models/recsys.py in TF2: the wide part (one weight per bucket, FTRL) and the deep part
    (embeddings into an MLP, Adagrad) of the same nine features and cross."""

    def __init__(self, user_buckets, item_buckets, buckets, hidden, ftrl_rate, learning_rate, rank=0, ranks=1):
        self.ranks = ranks
        self.sizes = dict(user_buckets=user_buckets, item_buckets=item_buckets, buckets=buckets)
        self.buckets = buckets
        self.tables = {name: tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
            list(words), tf.range(len(words), dtype=tf.int64)), -1) for name, words in recsys.VOCABULARIES.items()}
        rows = {name: self._rows(name) for name in recsys.FEATURES}
        wide = [tf.Variable(tf.zeros([rows[n], 1]), name=f"wide/{n}") for n in recsys.FEATURES]
        wide += [tf.Variable(tf.zeros([buckets, 1]), name="wide/cross"), tf.Variable(tf.zeros([1]), name="wide/bias")]
        deep = [tf.Variable(tf.random.stateless_truncated_normal([rows[n], width], seed=(500 + i, 0),
                                                                 stddev=1.0 / np.sqrt(width)), name=f"deep/{n}")
                for i, (n, (_, _, width)) in enumerate(recsys.FEATURES.items())]
        width = sum(w for _, _, w in recsys.FEATURES.values())
        for index, units in enumerate([*hidden, 1], start=1):
            # variance_scaling_initializer(2 for ReLU layers, 1 for the logit), truncated normal
            scale = 2.0 if index <= len(hidden) else 1.0
            stddev = np.sqrt(scale / width) / 0.87962566103423978
            deep += [tf.Variable(tf.random.stateless_truncated_normal([width, units], seed=(600 + index, 0),
                                                                      stddev=stddev), name=f"deep/fc{index}/kernel"),
                     tf.Variable(tf.zeros([units]), name=f"deep/fc{index}/bias")]
            width = units
        self.wide, self.deep, self.variables = wide, deep, wide + deep
        legacy = _legacy_optimizers()
        self.optimizers = [(legacy.Ftrl(ftrl_rate), range(len(wide))),
                           (legacy.Adagrad(learning_rate), range(len(wide), len(wide) + len(deep)))]

    def _rows(self, name):
        dtype, size_key, _ = recsys.FEATURES[name]
        return len(recsys.VOCABULARIES[name]) if size_key is None else self.sizes[size_key]

    def _ids(self, name, values):
        dtype, size_key, _ = recsys.FEATURES[name]
        if size_key is None:
            return self.tables[name].lookup(values)
        text = values if dtype == tf.string else tf.strings.as_string(values)
        return tf.strings.to_hash_bucket_fast(text, self.sizes[size_key])

    def global_rows(self, batch):
        return tf.size(batch["label"]) * self.ranks

    def ids(self, batch) -> dict:
        """A batch's rows in every table: each feature's, the cross's, and the label."""
        found = {name: self._ids(name, batch[name]) for name in recsys.FEATURES}
        found["cross"] = tf.sparse.cross_hashed([tf.expand_dims(batch[n], 1) for n in recsys.CROSS],
                                                self.buckets).values
        return dict(found, label=batch["label"])

    def losses(self, batch):
        ids = batch if "cross" in batch else self.ids(batch)
        cross = ids["cross"]
        n = len(recsys.FEATURES)
        wide = tf.add_n([tf.nn.embedding_lookup(w, ids[name]) for w, name in zip(self.wide, recsys.FEATURES)]
                        + [tf.nn.embedding_lookup(self.wide[n], cross)]) + self.wide[n + 1]
        x = tf.concat([tf.nn.embedding_lookup(e, ids[name]) for e, name in zip(self.deep, recsys.FEATURES)], axis=1)
        layers = self.deep[n:]
        for k in range(0, len(layers), 2):
            x = tf.nn.bias_add(tf.matmul(x, layers[k]), layers[k + 1])
            x = tf.nn.relu(x) if k + 2 < len(layers) else x
        logits = tf.squeeze(wide + x, axis=1)
        return tf.nn.sigmoid_cross_entropy_with_logits(labels=batch["label"], logits=logits)


def step_and_dataset(name: str, sizes: dict, input_fn, steps: int, ranks: int, per_rank: bool = False):
    """(the TF2 step, the dataset of global batches) of the model for ptf.run: batch k joins the
    `ranks` ranks' batches of step k as the model_fn form's input_fn gives them, so each rank
    trains on the rows it would there. `per_rank` (for --shard_reading, which reads elements
    r, r+N, ... on rank r): element k*N + r is rank r's batch of step k instead."""
    model = build(name, sizes)

    @tf.function
    def train_step(batch):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model.losses(batch))
        grads = tape.gradient(loss, model.variables)
        for optimizer, chosen in model.optimizers:
            optimizer.apply_gradients([(grads[i], model.variables[i]) for i in chosen])
        return loss

    # the batches made once, in memory (as a script reads a dataset that fits there): a rank's
    # steps then read them, not the input_fn that makes them
    batches = []
    for step in range(steps):
        parts = [input_fn(RunContext(r, ranks, 0, 1, step)) for r in range(ranks)]
        batches.extend(parts if per_rank else [{key: np.concatenate([p[key] for p in parts]) for key in parts[0]}])
    dataset = tf.data.Dataset.from_tensor_slices({key: np.stack([b[key] for b in batches]) for key in batches[0]})
    if name == "recsys":
        dataset = dataset.map(model.ids)
    return model, train_step, dataset
