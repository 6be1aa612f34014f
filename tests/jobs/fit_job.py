"""ptf.fit on a compiled tf_keras model (--case mlp: Sequential, 'adam', sparse labels; --case
wide_deep: functional, two Embedding inputs, a new-Keras Adagrad object, shuffle on). Rank 0
saves the trained weights and the History's losses, and single-device fit's, to --out."""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import parallax_tf as ptf  # noqa: E402
import tf_keras  # noqa: E402
from absl import app, flags  # noqa: E402

flags.DEFINE_string("case", "mlp", "mlp or wide_deep")
flags.DEFINE_string("out", None, "where rank 0 writes <case>.npz")
FLAGS = flags.FLAGS
EPOCHS = 2


def mlp():
    tf_keras.utils.set_random_seed(1)
    model = tf_keras.Sequential([tf_keras.layers.Dense(8, activation="relu", input_shape=(4,), name="h"),
                                 tf_keras.layers.Dense(3, name="out")])
    model.compile(optimizer="adam", loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    rng = np.random.RandomState(0)
    return model, rng.rand(100, 4).astype(np.float32), rng.randint(0, 3, 100), 16, False


def wide_deep():
    tf_keras.utils.set_random_seed(2)
    user = tf_keras.Input(shape=(1,), name="user", dtype="int64")
    item = tf_keras.Input(shape=(1,), name="item", dtype="int64")
    dense = tf_keras.Input(shape=(3,), name="dense")
    u = tf_keras.layers.Flatten()(tf_keras.layers.Embedding(50, 4, name="user_emb")(user))
    i = tf_keras.layers.Flatten()(tf_keras.layers.Embedding(40, 4, name="item_emb")(item))
    h = tf_keras.layers.Dense(8, activation="relu", name="deep")(tf_keras.layers.Concatenate()([u, i, dense]))
    model = tf_keras.Model([user, item, dense], tf_keras.layers.Dense(1, activation="sigmoid", name="click")(h))
    model.compile(optimizer=tf_keras.optimizers.Adagrad(0.1), loss="binary_crossentropy",
                  metrics=[tf_keras.metrics.AUC(name="auc"), "binary_accuracy"])
    rng = np.random.RandomState(0)
    x = {"user": rng.randint(0, 50, (90, 1)), "item": rng.randint(0, 40, (90, 1)),
         "dense": rng.rand(90, 3).astype(np.float32)}
    return model, x, rng.randint(0, 2, (90, 1)).astype(np.float32), 20, True


def main(argv):
    make = {"mlp": mlp, "wide_deep": wide_deep}[FLAGS.case]
    model, x, y, batch, shuffle = make()
    history = ptf.fit(model, x, y, batch_size=batch, epochs=EPOCHS, shuffle=shuffle)
    reference, x, y, batch, shuffle = make()
    want = {}
    rows = len(y)
    for epoch in range(EPOCHS):      # single-device fit on the epoch orders ptf.fit drew (seed + epoch)
        order = np.random.RandomState(epoch).permutation(rows) if shuffle else np.arange(rows)
        xs = {k: v[order] for k, v in x.items()} if isinstance(x, dict) else x[order]
        for key, values in reference.fit(xs, y[order], batch_size=batch, epochs=1, shuffle=False,
                                         verbose=0).history.items():
            want.setdefault(key, []).extend(values)
    if os.environ.get("HOROVOD_RANK", "0") == "0":
        np.savez(os.path.join(FLAGS.out, f"{FLAGS.case}.npz"), history=json.dumps(history.history),
                 reference_history=json.dumps(want),
                 **{f"got:{w.name}": v for w, v in zip(model.weights, model.get_weights())},
                 **{f"want:{w.name}": v for w, v in zip(reference.weights, reference.get_weights())})


if __name__ == "__main__":
    app.run(main)
