"""The TF2 scripts tests/jobs/tf2_job.py trains: each function trains its script through
ptf.run (or ptf.fit) and the same script on one device, and returns both (Outcome)."""
import dataclasses
import os
from typing import List

import numpy as np
import tensorflow as tf

import parallax_tf as ptf


@dataclasses.dataclass
class Outcome:
    weights: List[np.ndarray]          # the script's own variables after ptf.run
    reference: List[np.ndarray]        # the same script's, trained on one device
    losses: List[float]                # the mean over ranks, per step
    reference_losses: List[float]
    extra: dict = dataclasses.field(default_factory=dict)


ROWS, BATCH = 40, 16                   # an uneven last batch: 16, 16, 8


def _wide_data():
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 60, (ROWS, 3))
    feats = rng.rand(ROWS, 4).astype("float32")
    y = rng.rand(ROWS, 1).astype("float32")
    weight = rng.rand(ROWS).astype("float32") + 0.5
    return tf.data.Dataset.from_tensor_slices(({"ids": ids, "feats": feats}, y, weight)).batch(BATCH)


def _keras3_wide():
    import keras
    keras.utils.set_random_seed(1)
    ids = keras.Input((3,), dtype="int64", name="ids")
    feats = keras.Input((4,), name="feats")
    rows = keras.layers.Flatten()(keras.layers.Embedding(60, 4)(ids))
    hidden = keras.layers.Dense(6, activation="relu")(keras.layers.Concatenate()([rows, feats]))
    return keras.Model([ids, feats], keras.layers.Dense(1)(hidden)), keras.optimizers.Adam(0.05)


def _weighted_step(model, optimizer):
    import keras
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def step(x, y, weight):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True), sample_weight=weight)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step


def keras3_wide(strategy, hooks, **options):
    model, optimizer = _keras3_wide()
    result = ptf.run(_weighted_step(model, optimizer), _wide_data(), strategy=strategy, hooks=hooks, log_every=0,
                     **options)
    reference, ref_optimizer = _keras3_wide()
    step = _weighted_step(reference, ref_optimizer)
    want = [float(step(*element)) for element in _wide_data()]
    return Outcome([w.numpy() for w in model.weights], [w.numpy() for w in reference.weights],
                   result.mean_losses, want, {"plan": {v.name: v.route for v in result.plan.variables},
                                              **_split_plan(result)})


def _mlp_data():
    rng = np.random.RandomState(2)
    x = rng.rand(ROWS, 5).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, (x.sum(1, keepdims=True) > 2.5).astype("float32"))).batch(BATCH)


def _keras3_mlp():
    import keras
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    return model, keras.optimizers.SGD(0.1, momentum=0.9), keras.metrics.BinaryAccuracy(threshold=0.0)


def _metric_step(model, optimizer, accuracy):
    import keras
    loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        accuracy.update_state(y, logits)
        return {"loss": loss, "accuracy": accuracy.result()}
    return step


def keras3_metric(strategy, hooks):
    model, optimizer, accuracy = _keras3_mlp()
    result = ptf.run(_metric_step(model, optimizer, accuracy), _mlp_data(), strategy=strategy, hooks=hooks,
                     log_every=0)
    reference, ref_optimizer, ref_accuracy = _keras3_mlp()
    step = _metric_step(reference, ref_optimizer, ref_accuracy)
    want = [float(step(*element)["loss"]) for element in _mlp_data()]
    return Outcome([w.numpy() for w in model.weights], [w.numpy() for w in reference.weights],
                   result.mean_losses, want, {"accuracy": float(accuracy.result()),
                                              "reference_accuracy": float(ref_accuracy.result()),
                                              "count": float(accuracy.count.numpy()),
                                              "reference_count": float(ref_accuracy.count.numpy())})


def _tf_keras_model(optimizer: str = "Adagrad"):
    import tf_keras
    tf_keras.utils.set_random_seed(4)
    ids = tf_keras.Input((3,), dtype="int64")
    rows = tf_keras.layers.GlobalAveragePooling1D()(tf_keras.layers.Embedding(60, 4)(ids))
    made = tf_keras.optimizers.legacy.Ftrl(0.3) if optimizer == "legacy_ftrl" else tf_keras.optimizers.Adagrad(0.3)
    return tf_keras.Model(ids, tf_keras.layers.Dense(1)(rows)), made


def _tf_keras_step(model, optimizer):
    @tf.function
    def step(x, y, weight):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x["ids"], training=True) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step


def tf_keras_adagrad(strategy, hooks, optimizer: str = "Adagrad", rates=(0.3,), **options):
    """A run per learning rate in `rates`, set on the optimizer before it (a script that
    changes the rate between epochs)."""
    model, made = _tf_keras_model(optimizer)
    step, losses = _tf_keras_step(model, made), []
    for rate in rates:
        made.learning_rate = rate
        result = ptf.run(step, _wide_data(), strategy=strategy, hooks=hooks, log_every=0, **options)
        losses += result.mean_losses
    reference, ref_optimizer = _tf_keras_model(optimizer)
    ref_step, want = _tf_keras_step(reference, ref_optimizer), []
    for rate in rates:
        ref_optimizer.learning_rate = rate
        want += [float(ref_step(*element)) for element in _wide_data()]
    return Outcome([w.numpy() for w in model.weights + _variables_of(made)],
                   [w.numpy() for w in reference.weights + _variables_of(ref_optimizer)], losses, want,
                   _split_plan(result))


def _variables_of(optimizer) -> list:
    """An optimizer's variables (slots included): a method of a legacy tf_keras optimizer."""
    found = optimizer.variables
    return list(found() if callable(found) else found)


def _split_plan(result) -> dict:
    return {"shards": {v.name: len(v.shards) for v in result.plan.variables},
            "reasons": {v.name: v.reason for v in result.plan.variables}}


# --partitions=7: the table's 60 rows in shards of 9, 9, 9, 9, 8, 8, 8 rows
def tf_keras_adagrad_split(strategy, hooks):
    return tf_keras_adagrad(strategy, hooks, partitions=7)


def legacy_ftrl_split(strategy, hooks):
    # the legacy optimizer's rate is a variable the step only reads: each run reads it as it starts
    return tf_keras_adagrad(strategy, hooks, optimizer="legacy_ftrl", rates=(0.3, 0.1), partitions=7)


def module_split(strategy, hooks):
    return module(strategy, hooks, partitions=7)


def keras3_wide_split(strategy, hooks):
    return keras3_wide(strategy, hooks, partitions=7)


class Regression(tf.Module):
    """A table and a weight vector as plain variables."""

    def __init__(self):
        super().__init__()
        rng = np.random.RandomState(5)
        self.table = tf.Variable(rng.randn(60, 4).astype("float32"), name="table")
        self.w = tf.Variable(rng.randn(4, 1).astype("float32"), name="w")

    def __call__(self, ids):
        return tf.matmul(tf.reduce_mean(tf.gather(self.table, ids), 1), self.w)


def _hand_written_step(module):
    def step(x, y, weight):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(module(x["ids"]) - y))
        table_grad, w_grad = tape.gradient(loss, [module.table, module.w])
        module.w.assign_sub(0.1 * w_grad)
        module.table.scatter_sub(tf.IndexedSlices(0.1 * table_grad.values, table_grad.indices))
        return loss
    return step


def module(strategy, hooks, **options):
    trained = Regression()
    result = ptf.run(_hand_written_step(trained), _wide_data(), strategy=strategy, hooks=hooks, log_every=0,
                     **options)
    reference = Regression()
    step = _hand_written_step(reference)
    want = [float(step(*element)) for element in _wide_data()]
    return Outcome([trained.table.numpy(), trained.w.numpy()], [reference.table.numpy(), reference.w.numpy()],
                   result.mean_losses, want, {"plan": {v.name: v.route for v in result.plan.variables},
                                              **_split_plan(result)})


def module_shard_reading(strategy, hooks):
    """--shard_reading: each rank reads its own elements, so a step trains on N elements joined:
    single-device training on batches N times as large (every element holds 8 rows)."""
    rng = np.random.RandomState(10)
    ids, y = rng.randint(0, 60, (48, 3)), rng.rand(48, 1).astype("float32")
    data = tf.data.Dataset.from_tensor_slices(({"ids": ids}, y, np.ones(48, np.float32))).batch(8)
    trained = Regression()
    result = ptf.run(_hand_written_step(trained), data, strategy=strategy, hooks=hooks, log_every=0,
                     shard_reading=True)
    reference = Regression()
    step = _hand_written_step(reference)
    want = [float(step(*element)) for element in data.unbatch().batch(8 * ptf.size())]
    return Outcome([trained.table.numpy(), trained.w.numpy()], [reference.table.numpy(), reference.w.numpy()],
                   result.mean_losses, want)


def _guide_model():
    import keras
    keras.utils.set_random_seed(11)
    inputs = keras.Input((6,), name="digits")
    hidden = keras.layers.Dense(12, activation="relu", name="dense_1")(inputs)
    return keras.Model(inputs, keras.layers.Dense(4, name="predictions")(hidden))


def _guide_loop(model, epochs: int, distributed: bool, strategy, hooks):
    """Keras' "Writing a training loop from scratch": a tf.function train step updating a
    training metric, a validation loop after each epoch, both metrics reset per epoch."""
    import keras
    optimizer = keras.optimizers.SGD(learning_rate=0.1)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    train_acc, val_acc = keras.metrics.SparseCategoricalAccuracy(), keras.metrics.SparseCategoricalAccuracy()
    rng = np.random.RandomState(12)
    x, y = rng.rand(70, 6).astype("float32"), rng.randint(0, 4, 70)
    train = tf.data.Dataset.from_tensor_slices((x[:56], y[:56])).batch(16)
    val = tf.data.Dataset.from_tensor_slices((x[56:], y[56:])).batch(16)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss_value = loss_fn(y, logits)
        grads = tape.gradient(loss_value, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        train_acc.update_state(y, logits)
        return loss_value

    @tf.function
    def test_step(x, y):
        val_acc.update_state(y, model(x, training=False))

    logs = []
    for _ in range(epochs):
        if distributed:
            ptf.run(train_step, train, strategy=strategy, hooks=hooks, log_every=0)
        else:
            for batch_x, batch_y in train:
                train_step(batch_x, batch_y)
        for batch_x, batch_y in val:
            test_step(batch_x, batch_y)
        logs.append([float(train_acc.result()), float(val_acc.result())])
        train_acc.reset_state()
        val_acc.reset_state()
    return logs


def guide_training_loop(strategy, hooks):
    model, reference = _guide_model(), _guide_model()
    got = _guide_loop(model, 2, True, strategy, hooks)
    want = _guide_loop(reference, 2, False, strategy, hooks)
    return Outcome([w.numpy() for w in model.weights], [w.numpy() for w in reference.weights], [], [],
                   {"logs": got, "reference_logs": want})


def _structured_data():
    rng = np.random.RandomState(13)
    thal = np.array(["fixed", "normal", "reversible"])[rng.randint(0, 3, 64)]
    age = (rng.rand(64, 1) * 50 + 20).astype("float32")
    target = ((thal == "normal") ^ (age[:, 0] > 45)).astype("float32")
    return {"thal": thal, "age": age}, target


def _structured_fit():
    """Keras' "Structured data classification": a vocabulary lookup of a string feature in the
    dataset's map, an Embedding of its index, a normalised number, a sigmoid output."""
    import keras
    keras.utils.set_random_seed(14)
    thal = keras.Input((1,), dtype="int64", name="thal")
    age = keras.Input((1,), name="age")
    rows = keras.layers.Flatten()(keras.layers.Embedding(4, 3)(thal))
    normalised = keras.layers.Rescaling(1 / 70.0)(age)
    hidden = keras.layers.Dense(8, activation="relu")(keras.layers.concatenate([rows, normalised]))
    model = keras.Model({"thal": thal, "age": age}, keras.layers.Dense(1, activation="sigmoid")(hidden))
    model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
    return model


def structured_fit(strategy, hooks):
    import keras
    features, target = _structured_data()
    lookup = keras.layers.StringLookup(vocabulary=["fixed", "normal", "reversible"])

    def dataset():
        data = tf.data.Dataset.from_tensor_slices((features, target))
        return data.map(lambda x, y: ({"thal": tf.reshape(lookup(x["thal"]), [1]), "age": x["age"]}, y)).batch(16)

    def stop():
        return keras.callbacks.EarlyStopping(monitor="loss", min_delta=10, patience=1)
    model = _structured_fit()
    history = ptf.fit(model, dataset(), epochs=4, callbacks=[stop()], strategy=strategy, hooks=hooks, log_every=0,
                      verbose=0)
    reference = _structured_fit()
    want = reference.fit(dataset(), epochs=4, callbacks=[stop()], verbose=0).history
    return Outcome([w.numpy() for w in model.weights], [w.numpy() for w in reference.weights], [], [],
                   {"history": {k: list(map(float, v)) for k, v in history.history.items()},
                    "reference_history": {k: list(map(float, v)) for k, v in want.items()}})


def _fit_mlp():
    import keras
    keras.utils.set_random_seed(6)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def _fit_wide():
    import keras
    keras.utils.set_random_seed(7)
    user = keras.Input((1,), dtype="int64", name="user")
    dense = keras.Input((3,), name="dense")
    rows = keras.layers.Flatten()(keras.layers.Embedding(30, 4)(user))
    hidden = keras.layers.Dense(6, activation="relu")(keras.layers.Concatenate()([rows, dense]))
    model = keras.Model([user, dense], keras.layers.Dense(1, activation="sigmoid")(hidden))
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    return model


def _fitted(make, x, y, strategy, hooks, **arguments):
    model = make()
    history = ptf.fit(model, x, y, strategy=strategy, log_every=0, verbose=0, hooks=hooks, **arguments)
    reference = make()
    want = reference.fit(x, y, verbose=0, **arguments).history
    return Outcome([w.numpy() for w in model.weights], [w.numpy() for w in reference.weights], [], [],
                   {"history": {k: list(map(float, v)) for k, v in history.history.items()},
                    "reference_history": {k: list(map(float, v)) for k, v in want.items()}})


def keras3_fit_mlp(strategy, hooks):
    rng = np.random.RandomState(8)
    return _fitted(_fit_mlp, rng.rand(70, 5).astype("float32"), rng.randint(0, 3, 70), strategy, hooks,
                   batch_size=16, epochs=2, validation_split=0.2, shuffle=False)


def keras3_fit_wide(strategy, hooks):
    rng = np.random.RandomState(9)
    x = {"user": rng.randint(0, 30, (60, 1)), "dense": rng.rand(60, 3).astype("float32")}
    y = rng.randint(0, 2, 60).astype("float32")          # shape (N,), the output's (N, 1)
    return _fitted(_fit_wide, x, y, strategy, hooks, batch_size=16, epochs=2, shuffle=False)


DYNAMIC_IDS = 10 ** 12 + 7919 * np.arange(25)        # ids with no vocabulary behind them


def _dynamic_wide(dynamic: bool):
    """A wide-and-deep whose ids go through ptf.keras.DynamicEmbedding, or (the reference) whose
    one-hot ids over DYNAMIC_IDS go through a bias-free Dense layer whose rows start as the
    table's initial rows of those ids: a dense gradient, summed per id as the table's push is
    (a Keras Embedding's Adagrad squares each occurrence's gradient instead)."""
    import keras
    keras.utils.set_random_seed(11)
    dense = keras.Input((3,), name="dense")
    if dynamic:
        ids = keras.Input((), dtype="int64", name="ids")
        rows = ptf.keras.DynamicEmbedding(4, name="items")(ids)
    else:
        ids = keras.Input((len(DYNAMIC_IDS),), name="ids")
        options = ptf.keras.DynamicEmbedding(4, name="items")._options
        start = options.initializer.rows(tf.constant(DYNAMIC_IDS), 4, options.seed, tf.float32, standard_ops=True)
        rows = keras.layers.Dense(4, use_bias=False, kernel_initializer=keras.initializers.Constant(start.numpy()),
                                  name="items")(ids)
    hidden = keras.layers.Dense(6, activation="relu", name="hidden")(keras.layers.Concatenate()([rows, dense]))
    model = keras.Model([ids, dense], keras.layers.Dense(1, activation="sigmoid", name="out")(hidden))
    model.compile(optimizer=keras.optimizers.Adagrad(0.3), loss="binary_crossentropy", metrics=["accuracy"])
    return model


def keras3_fit_dynamic(strategy, hooks):
    """A Keras 3 wide-and-deep with a dynamic table through ptf.fit, against model.fit of the
    reference (_dynamic_wide): Adagrad moves only the rows a batch reads, as the table's rule does,
    and Keras' epsilon is below float32's resolution here. The table's rows, the dense weights,
    History and predict are compared; rank 0 exports the model."""
    rng = np.random.RandomState(12)
    at = rng.randint(0, len(DYNAMIC_IDS), 60)
    dense = rng.rand(60, 3).astype("float32")
    y = ((at % 3 == 0) ^ (dense[:, 0] > 0.5)).astype("float32")
    model, reference = _dynamic_wide(True), _dynamic_wide(False)
    for name in ("hidden", "out"):
        reference.get_layer(name).set_weights(model.get_layer(name).get_weights())
    arguments = dict(batch_size=16, epochs=3, shuffle=False)
    history = ptf.fit(model, {"ids": DYNAMIC_IDS[at], "dense": dense}, y, strategy=strategy, log_every=0, verbose=0,
                      hooks=hooks, **arguments)
    one_hot = np.eye(len(DYNAMIC_IDS), dtype="float32")[at]
    want = reference.fit({"ids": one_hot, "dense": dense}, y, verbose=0, **arguments).history
    state = model.get_layer("items").state
    trained = reference.get_layer("items").get_weights()[0][np.searchsorted(DYNAMIC_IDS, state["ids"])]
    served = {"ids": DYNAMIC_IDS[at][:8], "dense": dense[:8]}
    extra = {"history": {k: list(map(float, v)) for k, v in history.history.items()},
             "reference_history": {k: list(map(float, v)) for k, v in want.items()},
             "predict": model.predict(served, verbose=0).ravel().tolist(),
             "reference_predict": reference.predict({"ids": one_hot[:8], "dense": dense[:8]},
                                                    verbose=0).ravel().tolist(),
             "table_routes": [table.route for table in history.plan.dynamic_tables]}
    if ptf.rank() == 0:
        export = os.path.join(os.environ["PTF_TF2_OUT"], f"dynamic_export.{strategy}")
        model.export(export, verbose=False)
        np.savez(export + ".npz", **served)
    return Outcome([state["values"], *[w.numpy() for w in model.weights]],
                   [trained, *[w.numpy() for w in reference.weights if "items" not in w.path]], [], [], extra)


CASES = {"keras3_fit_dynamic": keras3_fit_dynamic,
         "guide_training_loop": guide_training_loop, "structured_fit": structured_fit,
         "module_shard_reading": module_shard_reading, "keras3_wide": keras3_wide, "keras3_metric": keras3_metric, "tf_keras_adagrad": tf_keras_adagrad,
         "module": module, "tf_keras_adagrad_split": tf_keras_adagrad_split, "legacy_ftrl_split": legacy_ftrl_split,
         "module_split": module_split, "keras3_wide_split": keras3_wide_split, "keras3_fit_mlp": keras3_fit_mlp, "keras3_fit_wide": keras3_fit_wide}
