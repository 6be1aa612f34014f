"""ptf.fit against single-device tf_keras fit, run eagerly in the same job. --runs is a list of
case:strategy; each rank saves, per run, the trained weights, the History (and the
reference's) to --out/<case>.<strategy>.rank<r>.npz.

mlp: Sequential, 'adam', sparse labels, accuracy, shuffle on, validation_split, class_weight.
wide_deep: functional, two Embedding inputs, a new-Keras Adagrad object, AUC and binary
  accuracy, validation_data, EarlyStopping (stops after 2 of 4 epochs), ModelCheckpoint,
  CSVLogger and a custom on_epoch_end callback on rank 0.
subclassed: a subclassed model through the function form, trained from a tf.data dataset of
  (x, y, sample_weight) batches, validated on a dataset.
cnn: Sequential convolutions under a dense head (stanza's split), 'sgd' with momentum by
  object, accuracy, shuffle on, an uneven last batch, validation_split.
two_heads: functional, two outputs with a loss dict (a function and a string), loss_weights,
  a metric on one output, a new-Keras RMSprop on a decaying learning-rate schedule,
  TerminateOnNaN.
guide_*: the Keras guides' scripts (tests/jobs/keras_guides.py).
dynamic_wide: functional, ids without a vocabulary through ptf.tf_keras.DynamicEmbedding, a
  new-Keras Adagrad, validation_data; against fit of the same model whose one-hot ids go through
  a bias-free Dense layer starting from the table's initial rows (a dense gradient, summed per
  id as the table's push is); rank 0 saves a SavedModel."""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import parallax_tf as ptf  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402
from absl import app, flags  # noqa: E402

from tests.jobs import keras_guides  # noqa: E402

flags.DEFINE_list("runs", ["mlp:hybrid"], "case:strategy, ...")
flags.DEFINE_string("out", None, "where each rank writes <case>.<strategy>.rank<r>.npz")
FLAGS = flags.FLAGS
RANK = int(os.environ.get("HOROVOD_RANK", "0"))


def mlp_model():
    tf_keras.utils.set_random_seed(1)
    model = tf_keras.Sequential([tf_keras.layers.Dense(8, activation="relu", input_shape=(4,), name="h"),
                                 tf_keras.layers.Dense(3, name="out")])
    model.compile(optimizer="adam", loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def mlp(strategy):
    rng = np.random.RandomState(0)
    x, y = rng.rand(100, 4).astype(np.float32), rng.randint(0, 3, 100)
    weights = {0: 1.0, 1: 2.0, 2: 0.5}
    model = mlp_model()
    history = ptf.fit(model, x, y, batch_size=16, epochs=2, validation_split=0.2, class_weight=weights,
                      strategy=strategy)
    reference, want = mlp_model(), {}
    for epoch in range(2):      # single-device fit on the epoch orders ptf.fit drew (seed + epoch)
        order = np.random.RandomState(epoch).permutation(80)
        for key, values in reference.fit(x[:80][order], y[:80][order], batch_size=16, epochs=1, shuffle=False,
                                         class_weight=weights, validation_data=(x[80:], y[80:]),
                                         verbose=0).history.items():
            want.setdefault(key, []).extend(values)
    return model, history, reference, want


def wide_deep_model():
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
    return model


class EpochsSeen(tf_keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append([epoch, float(logs["val_auc"]), float(self.model.get_weights()[0].sum())])


def wide_deep(strategy):
    rng = np.random.RandomState(0)
    x = {"user": rng.randint(0, 50, (110, 1)), "item": rng.randint(0, 40, (110, 1)),
         "dense": rng.rand(110, 3).astype(np.float32)}
    y = rng.randint(0, 2, (110, 1)).astype(np.float32)
    train, val = ({k: v[:90] for k, v in x.items()}, y[:90]), ({k: v[90:] for k, v in x.items()}, y[90:])

    def stop():      # no epoch improves the loss by 10: stops after epoch 2 of 4
        return tf_keras.callbacks.EarlyStopping(monitor="loss", min_delta=10, patience=1)
    seen = EpochsSeen()
    out = os.path.join(FLAGS.out, f"wide_deep.{strategy}")
    callbacks = [stop(), seen, tf_keras.callbacks.CSVLogger(out + ".csv"),
                 tf_keras.callbacks.ModelCheckpoint(out + ".weights.h5", save_weights_only=True)]
    model = wide_deep_model()
    history = ptf.fit(model, *train, batch_size=20, epochs=4, shuffle=False, validation_data=val,
                      callbacks=callbacks, strategy=strategy)
    history.history["seen"] = seen.seen
    if RANK == 0:     # Keras' own SavedModel of the trained model (tests/test_export serves it)
        model.save(out + ".saved", save_format="tf")
        np.savez(out + ".served.npz", **{k: v[90:] for k, v in x.items()},
                 predictions=model.predict({k: v[90:] for k, v in x.items()}, verbose=0))
    reference = wide_deep_model()
    seen_there = EpochsSeen()
    want = reference.fit(*train, batch_size=20, epochs=4, shuffle=False, validation_data=val,
                         callbacks=[stop(), seen_there], verbose=0).history
    want["seen"] = seen_there.seen
    return model, history, reference, want


class Subclassed(tf_keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = tf_keras.layers.Dense(6, activation="tanh")
        self.top = tf_keras.layers.Dense(1)

    def call(self, inputs):
        return self.top(self.hidden(inputs))


def subclassed_model():
    tf_keras.utils.set_random_seed(3)
    model = Subclassed()
    model.compile(optimizer=tf_keras.optimizers.SGD(0.1, momentum=0.5), loss="mse", metrics=["mae"])
    return model


def subclassed(strategy):
    rng = np.random.RandomState(0)
    x, y, w = rng.rand(70, 5).astype(np.float32), rng.rand(70, 1).astype(np.float32), rng.rand(70).astype(np.float32)
    data = tf.data.Dataset.from_tensor_slices((x[:60], y[:60], w[:60])).batch(16)
    val = tf.data.Dataset.from_tensor_slices((x[60:], y[60:])).batch(4)
    history = ptf.fit(subclassed_model, data, epochs=2, validation_data=val, strategy=strategy)
    reference = subclassed_model()
    want = reference.fit(data, epochs=2, validation_data=val, verbose=0).history
    return history.model, history, reference, want


def cnn_model():
    tf_keras.utils.set_random_seed(4)
    model = tf_keras.Sequential([tf_keras.layers.Conv2D(3, 3, activation="relu", input_shape=(6, 6, 1), name="conv"),
                                 tf_keras.layers.Flatten(),
                                 tf_keras.layers.Dense(8, activation="relu", name="fc"),
                                 tf_keras.layers.Dense(3, name="logits")])
    model.compile(optimizer=tf_keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def cnn(strategy):
    rng = np.random.RandomState(0)
    x, y = rng.rand(90, 6, 6, 1).astype(np.float32), rng.randint(0, 3, 90)
    model = cnn_model()
    history = ptf.fit(model, x, y, batch_size=16, epochs=2, validation_split=0.2, strategy=strategy)
    reference, want = cnn_model(), {}
    for epoch in range(2):      # 72 rows: four batches of 16 and one of 8
        order = np.random.RandomState(epoch).permutation(72)
        for key, values in reference.fit(x[:72][order], y[:72][order], batch_size=16, epochs=1, shuffle=False,
                                         validation_data=(x[72:], y[72:]), verbose=0).history.items():
            want.setdefault(key, []).extend(values)
    return model, history, reference, want


def two_heads_model():
    tf_keras.utils.set_random_seed(5)
    x = tf_keras.Input(shape=(4,), name="x")
    shared = tf_keras.layers.Dense(6, activation="relu", name="shared")(x)
    model = tf_keras.Model(x, [tf_keras.layers.Dense(2, name="a")(shared),
                               tf_keras.layers.Dense(1, activation="sigmoid", name="b")(shared)])
    schedule = tf_keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=3, decay_rate=0.5)

    def absolute(target, prediction):
        return tf.reduce_mean(tf.abs(target - prediction), axis=-1)
    model.compile(optimizer=tf_keras.optimizers.RMSprop(schedule), loss={"a": absolute, "b": "binary_crossentropy"},
                  loss_weights={"a": 0.3, "b": 2.0}, metrics={"b": ["binary_accuracy"]})
    return model


def two_heads(strategy):
    rng = np.random.RandomState(0)
    x = rng.rand(60, 4).astype(np.float32)
    y = {"a": rng.rand(60, 2).astype(np.float32), "b": rng.randint(0, 2, (60, 1)).astype(np.float32)}
    model = two_heads_model()
    history = ptf.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, validation_split=0.25,
                      callbacks=[tf_keras.callbacks.TerminateOnNaN()], strategy=strategy)
    reference = two_heads_model()
    want = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, validation_split=0.25, verbose=0).history
    return model, history, reference, want


DYNAMIC_IDS = 10 ** 12 + 7919 * np.arange(25)        # ids with no vocabulary behind them


def dynamic_wide_model(dynamic: bool):
    tf_keras.utils.set_random_seed(3)
    dense = tf_keras.Input(shape=(3,), name="dense")
    if dynamic:
        ids = tf_keras.Input(shape=(), name="ids", dtype="int64")
        rows = ptf.tf_keras.DynamicEmbedding(4, name="items")(ids)
    else:
        ids = tf_keras.Input(shape=(len(DYNAMIC_IDS),), name="ids")
        options = ptf.tf_keras.DynamicEmbedding(4, name="items")._options
        start = options.initializer.rows(tf.constant(DYNAMIC_IDS), 4, options.seed, tf.float32, standard_ops=True)
        rows = tf_keras.layers.Dense(4, use_bias=False, name="items",
                                     kernel_initializer=tf_keras.initializers.Constant(start.numpy()))(ids)
    h = tf_keras.layers.Dense(6, activation="relu", name="deep")(tf_keras.layers.Concatenate()([rows, dense]))
    model = tf_keras.Model([ids, dense], tf_keras.layers.Dense(1, activation="sigmoid", name="click")(h))
    model.compile(optimizer=tf_keras.optimizers.Adagrad(0.3), loss="binary_crossentropy",
                  metrics=["binary_accuracy"])
    return model


class _Weights:
    """What main compares: the table's rows (of the ids it holds, against the reference's rows of
    them), then the dense weights."""
    def __init__(self, weights):
        self.weights = weights

    def get_weights(self):
        return self.weights


def dynamic_wide(strategy):
    rng = np.random.RandomState(4)
    at = rng.randint(0, len(DYNAMIC_IDS), 80)
    dense = rng.rand(80, 3).astype(np.float32)
    y = ((at % 3 == 0) ^ (dense[:, 0] > 0.5)).astype(np.float32)
    one_hot = np.eye(len(DYNAMIC_IDS), dtype=np.float32)[at]
    model, reference = dynamic_wide_model(True), dynamic_wide_model(False)
    for name in ("deep", "click"):
        reference.get_layer(name).set_weights(model.get_layer(name).get_weights())
    val = ({"ids": DYNAMIC_IDS[at[64:]], "dense": dense[64:]}, y[64:])
    history = ptf.fit(model, {"ids": DYNAMIC_IDS[at[:64]], "dense": dense[:64]}, y[:64], batch_size=16, epochs=3,
                      shuffle=False, validation_data=val, strategy=strategy, log_every=0, verbose=0)
    want = reference.fit({"ids": one_hot[:64], "dense": dense[:64]}, y[:64], batch_size=16, epochs=3, shuffle=False,
                         validation_data=({"ids": one_hot[64:], "dense": dense[64:]}, y[64:]), verbose=0).history
    state = model.get_layer("items").state
    if RANK == 0:     # Keras' own SavedModel of the trained model (tests/test_fit serves it)
        out = os.path.join(FLAGS.out, f"dynamic_wide.{strategy}")
        model.save(out + ".saved", save_format="tf")
        np.savez(out + ".served.npz", ids=val[0]["ids"], dense=val[0]["dense"],
                 predictions=model.predict(val[0], verbose=0))
    kernel = reference.get_layer("items").get_weights()[0]
    dense_of = ("deep", "click")
    return (_Weights([state["values"], *[w for n in dense_of for w in model.get_layer(n).get_weights()]]), history,
            _Weights([kernel[np.searchsorted(DYNAMIC_IDS, state["ids"])],
                      *[w for n in dense_of for w in reference.get_layer(n).get_weights()]]), want)


def main(argv):
    for run in FLAGS.runs:
        case, strategy = run.split(":")
        cases = {"mlp": mlp, "wide_deep": wide_deep, "subclassed": subclassed, "cnn": cnn, "two_heads": two_heads,
                 "dynamic_wide": dynamic_wide,
                 **{f"guide_{name}": run for name, run in keras_guides.CASES.items()}}
        model, history, reference, want = cases[case](strategy)
        assert (history.rank, history.size) == (RANK, int(os.environ["HOROVOD_SIZE"]))
        np.savez(os.path.join(FLAGS.out, f"{case}.{strategy}.rank{history.rank}.npz"),
                 history=json.dumps({"epoch": history.epoch, **history.history}),
                 reference_history=json.dumps(want),     # weights in the models' order (a subclassed
                 **{f"got:{i}": v for i, v in enumerate(model.get_weights())},     # one's names differ)
                 **{f"want:{i}": v for i, v in enumerate(reference.get_weights())})


if __name__ == "__main__":
    app.run(main)
