"""The recommendation model as a Keras compile/fit script, trained by ptf.fit: a functional
wide & deep click model with Embedding inputs, a new-Keras Adagrad and AUC.

Inputs: user_id and item_id (large vocabularies: Embedding tables on the PS route under
hybrid), category and device (small ones), and 4 dense features (counts). Deep part: the embeddings
and the dense features through a 64-32 MLP; wide part: one weight per user and item id
(Embedding of width 1). Data: Zipf-distributed ids, a click drawn from hidden per-id weights
(generated, deterministic in --krec_seed). With --krec_dynamic the user and item ids go through
ptf.tf_keras.DynamicEmbedding tables instead (rows for the ids met, no vocabulary), and ids are
drawn from the whole int64 range.

    python -m models.keras_recsys --np 2 --krec_epochs 2 [--krec_dynamic]
"""
from __future__ import annotations

import numpy as np
import parallax_tf as ptf  # before TF (keeps its import-time logs quiet); registers --np, --strategy, ...
from absl import app, flags

flags.DEFINE_integer("krec_rows", 20000, "Examples generated (the last 10% validate).")
flags.DEFINE_integer("krec_batch", 256, "Global batch (Keras' batch_size: all ranks together).")
flags.DEFINE_integer("krec_epochs", 2, "Epochs.")
flags.DEFINE_integer("krec_users", 50000, "user_id vocabulary (rows of the large Embedding table).")
flags.DEFINE_integer("krec_items", 5000, "item_id vocabulary.")
flags.DEFINE_integer("krec_seed", 0, "Data and initial-weight seed.")
flags.DEFINE_bool("krec_dynamic", False, "user_id and item_id through dynamic tables (ptf.tf_keras.DynamicEmbedding).")
FLAGS = flags.FLAGS

SMALL = {"category": 30, "device": 4}
DENSE = 4


LARGE = ("user_id", "item_id")
ID_SPREAD = 2 ** 40 + 1         # --krec_dynamic: id k becomes k * ID_SPREAD, far beyond any vocabulary


def build_model(users: int = 50000, items: int = 5000, seed: int = 0, dynamic: bool = False):
    """The compiled functional model (`dynamic`: the large vocabularies as dynamic tables)."""
    import tf_keras
    layers = tf_keras.layers
    tf_keras.utils.set_random_seed(seed)
    ids = {name: tf_keras.Input(shape=(1,), name=name, dtype="int64")
           for name in ("user_id", "item_id", *SMALL)}
    dense = tf_keras.Input(shape=(DENSE,), name="counts")
    sizes = {"user_id": users, "item_id": items, **SMALL}
    widths = {"user_id": 16, "item_id": 16, "category": 4, "device": 4}

    def table(name: str, width: int, suffix: str):
        if dynamic and name in LARGE:
            return ptf.tf_keras.DynamicEmbedding(width, name=f"{name}_{suffix}",      # Embedding's law
                                                 initializer=tf_keras.initializers.RandomUniform(-0.05, 0.05))
        return layers.Embedding(sizes[name], width, name=f"{name}_{suffix}")
    deep = [layers.Flatten()(table(n, widths[n], "embedding")(ids[n])) for n in ids]
    hidden = layers.Concatenate()(deep + [dense])
    for units in (64, 32):
        hidden = layers.Dense(units, activation="relu")(hidden)
    wide = [layers.Flatten()(table(n, 1, "wide")(ids[n])) for n in LARGE]
    logit = layers.Add()([layers.Dense(1, name="deep_logit")(hidden), *wide])
    model = tf_keras.Model([*ids.values(), dense], layers.Activation("sigmoid", name="click")(logit))
    model.compile(optimizer=tf_keras.optimizers.Adagrad(0.05), loss="binary_crossentropy",
                  metrics=[tf_keras.metrics.AUC(name="auc")])
    return model


def make_data(rows: int, users: int = 50000, items: int = 5000, seed: int = 0, dynamic: bool = False):
    """(x as a dict by input name, y): Zipf ids, clicks from hidden per-id weights (`dynamic`: the
    large vocabularies' ids spread over the int64 range)."""
    rng = np.random.RandomState(seed)
    sizes = {"user_id": users, "item_id": items, **SMALL}
    x = {name: (rng.zipf(1.3, (rows, 1)) - 1) % size for name, size in sizes.items()}
    x["counts"] = rng.rand(rows, DENSE).astype(np.float32)
    hidden = {name: np.random.RandomState(seed + 1 + i).normal(0, 1, size) for i, (name, size) in enumerate(sizes.items())}
    logit = sum(hidden[name][x[name][:, 0]] for name in sizes) + x["counts"] @ np.linspace(-1, 1, DENSE) - 0.5
    y = (rng.rand(rows) < 1 / (1 + np.exp(-logit))).astype(np.float32).reshape(-1, 1)
    if dynamic:
        x.update({name: x[name] * ID_SPREAD for name in LARGE})
    return x, y


def main(argv):
    x, y = make_data(FLAGS.krec_rows, FLAGS.krec_users, FLAGS.krec_items, FLAGS.krec_seed, FLAGS.krec_dynamic)
    model = build_model(FLAGS.krec_users, FLAGS.krec_items, FLAGS.krec_seed, FLAGS.krec_dynamic)
    history = ptf.fit(model, x, y, batch_size=FLAGS.krec_batch, epochs=FLAGS.krec_epochs, validation_split=0.1)
    if history.history and ptf.rank() == 0:
        print(f"keras_recsys: val_auc {history.history['val_auc'][-1]:.4f}", flush=True)


if __name__ == "__main__":
    app.run(main)
