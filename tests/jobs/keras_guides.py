"""The Keras guides' standard compile/fit scripts, ported to ptf.fit by changing only the fit line
(each function returns the ptf.fit model and History, and single-device fit's). The guides'
Dropout layers are left out: a dropout mask is drawn per rank, so no distributed run repeats
single-device dropout. Data are small synthetic stand-ins of the guides' datasets.

mnist_mlp: "Training & evaluation with the built-in methods": Sequential through a function that
  builds and compiles it, 'adam', SparseCategoricalCrossentropy(from_logits=True), accuracy,
  validation_split, shuffled epochs.
mnist_cnn: "Simple MNIST convnet": Conv2D, MaxPooling2D, softmax over one-hot labels,
  'categorical_crossentropy', 'adam'.
imdb: "Text classification from scratch": Embedding, GlobalAveragePooling1D, a sigmoid output,
  'binary_crossentropy' on labels of shape (N,), 'adam'.
structured: "Structured data classification from scratch": a functional model over a dict of
  inputs, an adapted Normalization and CategoryEncoding, labels of shape (N,), 'adam'."""
import numpy as np
import tf_keras

import parallax_tf as ptf


def _replayed(make, x, y, epochs, batch_size, validation_split):
    """Single-device fit of a fresh model on the epoch orders ptf.fit draws (seed + epoch), with
    the rows validation_split holds out."""
    reference, want = make(), {}
    rows = int(np.floor(len(y) * (1.0 - validation_split)))       # as Keras splits
    pick = (lambda v, at: {k: a[at] for k, a in v.items()}) if isinstance(x, dict) else (lambda v, at: v[at])
    train, held = np.arange(rows), np.arange(rows, len(y))
    for epoch in range(epochs):
        order = train[np.random.RandomState(epoch).permutation(rows)]
        found = reference.fit(pick(x, order), y[order], batch_size=batch_size, epochs=1, shuffle=False,
                              validation_data=(pick(x, held), y[held]), verbose=0).history
        for key, values in found.items():
            want.setdefault(key, []).extend(values)
    return reference, want


def _fit(make, x, y, strategy, model=None, epochs=2, batch_size=16, validation_split=0.2):
    history = ptf.fit(model if model is not None else make, x, y, batch_size=batch_size, epochs=epochs,
                      validation_split=validation_split, strategy=strategy)
    return (history.model, history, *_replayed(make, x, y, epochs, batch_size, validation_split))


def mnist_mlp_model():
    tf_keras.utils.set_random_seed(11)
    model = tf_keras.Sequential([tf_keras.layers.Flatten(input_shape=(8, 8)),
                                 tf_keras.layers.Dense(16, activation="relu"),
                                 tf_keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def mnist_mlp(strategy):
    rng = np.random.RandomState(1)
    return _fit(mnist_mlp_model, rng.rand(90, 8, 8).astype("float32"), rng.randint(0, 10, 90), strategy)


def mnist_cnn_model():
    tf_keras.utils.set_random_seed(12)
    model = tf_keras.Sequential([tf_keras.Input(shape=(8, 8, 1)),
                                 tf_keras.layers.Conv2D(4, kernel_size=(3, 3), activation="relu"),
                                 tf_keras.layers.MaxPooling2D(pool_size=(2, 2)),
                                 tf_keras.layers.Flatten(),
                                 tf_keras.layers.Dense(10, activation="softmax")])
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    return model


def mnist_cnn(strategy):
    rng = np.random.RandomState(2)
    y = tf_keras.utils.to_categorical(rng.randint(0, 10, 80), 10)
    return _fit(mnist_cnn_model, rng.rand(80, 8, 8, 1).astype("float32"), y, strategy, model=mnist_cnn_model())


def imdb_model():
    tf_keras.utils.set_random_seed(13)
    model = tf_keras.Sequential([tf_keras.Input(shape=(12,), dtype="int64"),
                                 tf_keras.layers.Embedding(200, 8),
                                 tf_keras.layers.GlobalAveragePooling1D(),
                                 tf_keras.layers.Dense(8, activation="relu"),
                                 tf_keras.layers.Dense(1, activation="sigmoid")])
    model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"])
    return model


def imdb(strategy):
    rng = np.random.RandomState(3)
    tokens = rng.randint(0, 200, (100, 12))
    labels = (tokens.mean(1) > 100).astype("int64")          # shape (N,), as the guide's
    return _fit(imdb_model, tokens, labels, strategy, model=imdb_model())


STRUCTURED = {"age": np.random.RandomState(4).rand(96, 1).astype("float32") * 60 + 20,
              "chol": np.random.RandomState(5).rand(96, 1).astype("float32") * 200 + 150,
              "cp": np.random.RandomState(6).randint(0, 4, (96, 1))}


def structured_model():
    tf_keras.utils.set_random_seed(14)
    inputs, encoded = {}, []
    for name in ("age", "chol"):
        inputs[name] = tf_keras.Input(shape=(1,), name=name)
        normalizer = tf_keras.layers.Normalization()
        normalizer.adapt(STRUCTURED[name])
        encoded.append(normalizer(inputs[name]))
    inputs["cp"] = tf_keras.Input(shape=(1,), name="cp", dtype="int64")
    encoded.append(tf_keras.layers.CategoryEncoding(num_tokens=4, output_mode="one_hot")(inputs["cp"]))
    hidden = tf_keras.layers.Dense(16, activation="relu")(tf_keras.layers.concatenate(encoded))
    model = tf_keras.Model(inputs, tf_keras.layers.Dense(1, activation="sigmoid")(hidden))
    model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
    return model


def structured(strategy):
    target = ((STRUCTURED["age"][:, 0] > 45) ^ (STRUCTURED["cp"][:, 0] == 2)).astype("float32")
    return _fit(structured_model, STRUCTURED, target, strategy, model=structured_model())


CASES = {"mnist_mlp": mnist_mlp, "mnist_cnn": mnist_cnn, "imdb": imdb, "structured": structured}
