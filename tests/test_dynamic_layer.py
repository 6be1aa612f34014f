"""ptf.keras.DynamicEmbedding and ptf.tf_keras.DynamicEmbedding in one process: what the layer
reads outside the toolkit's graphs, its saved forms, and the row rules of Keras optimizers (the
layer trained on ranks: tests/test_tf2.py, tests/test_fit.py, tests/test_export.py)."""
import numpy as np
import pytest

import parallax_tf as ptf
from parallax_tf.dynamic.rules import rule_for


def _state(name: str, ids, values) -> dict:
    ids = np.asarray(ids, np.int64)
    return {f"{name}/ids": ids, f"{name}/values": np.asarray(values, np.float32), f"{name}/seen_ids": ids,
            f"{name}/counts": np.ones_like(ids), f"{name}/last_seen": np.zeros_like(ids),
            f"{name}/clock": np.array([1, len(ids), 0], np.int64)}


@pytest.mark.parametrize("library", ["keras", "tf_keras"])
def test_the_layer_reads_its_live_rows_and_what_training_would_read_for_other_ids(library):
    keras = pytest.importorskip(library)
    layer_class = getattr(ptf, library).DynamicEmbedding
    ids = keras.Input((), dtype="int64", name="ids")
    fresh = layer_class(3, name="fresh", initializer=ptf.dynamic.constant(0.5))
    waiting = layer_class(3, name="waiting", admit_after=2)
    model = keras.Model(ids, [fresh(ids), waiting(ids)])
    fresh.take(_state("fresh", [5, 9], [[1, 2, 3], [4, 5, 6]]))
    got_fresh, got_waiting = model.predict(np.array([9, 7, 5], np.int64), verbose=0)
    np.testing.assert_array_equal(got_fresh, [[4, 5, 6], [0.5, 0.5, 0.5], [1, 2, 3]])
    np.testing.assert_array_equal(got_waiting, np.zeros([3, 3]))     # not admitted yet: zeros
    assert sorted(fresh.state) == ["clock", "counts", "ids", "last_seen", "seen_ids", "values"]


def test_a_saved_keras_file_keeps_the_rows_the_law_and_the_seed():
    import keras
    ids = keras.Input((), dtype="int64")
    layer = ptf.keras.DynamicEmbedding(3, name="items", initializer=ptf.dynamic.uniform(0.2))
    model = keras.Model(ids, layer(ids))
    layer.take(_state("items", [5, 9], np.ones([2, 3])))
    query = np.array([5, 7, 9], np.int64)
    want = model.predict(query, verbose=0)
    path = f"{pytest.importorskip('tempfile').mkdtemp()}/model.keras"
    model.save(path)
    back = keras.models.load_model(path)
    np.testing.assert_array_equal(back.predict(query, verbose=0), want)
    assert 0 < np.abs(want[1]).max() <= 0.2 and back.get_layer("items").get_config()["seed"] == layer._options.seed


def test_training_the_layer_outside_parallax_tf_is_refused_in_one_line():
    import keras
    ids = keras.Input((), dtype="int64")
    model = keras.Model(ids, keras.layers.Dense(1)(ptf.keras.DynamicEmbedding(2, name="items")(ids)))
    model.compile("sgd", "mse")
    with pytest.raises(ptf.ModelError, match=r"^DynamicEmbedding 'items' is called to train outside parallax_tf, "
                                             r"which would not train it: train the model with ptf.fit"):
        model.fit(np.array([1, 2], np.int64), np.zeros([2, 1], np.float32), verbose=0)


def test_keras_optimizers_give_their_tf1_twins_row_rules():
    import keras
    import tf_keras
    momentum = rule_for(keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True))
    assert (momentum.kind, momentum.hyper["learning_rate"], momentum.hyper["momentum"], momentum.hyper["nesterov"]) \
        == ("momentum", pytest.approx(0.1), 0.9, True)
    assert rule_for(keras.optimizers.SGD(0.1)).kind == "sgd"
    adagrad = rule_for(keras.optimizers.Adagrad(0.2, initial_accumulator_value=0.3))
    assert adagrad.kind == "adagrad" and adagrad.slots == [("accumulator", pytest.approx(0.3))]
    adam = rule_for(tf_keras.optimizers.legacy.Adam(0.01, beta_1=0.8))
    assert adam.kind == "adam" and adam.hyper["beta1"] == pytest.approx(0.8)
    ftrl = rule_for(keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.01,
                                          l2_shrinkage_regularization_strength=0.2))
    assert ftrl.kind == "ftrl" and ftrl.hyper["l2_shrinkage"] == pytest.approx(0.2)


@pytest.mark.parametrize("optimizer,message", [
    (lambda keras: keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)),
     r"^a dynamic embedding table trains with a constant learning rate, and Adam's follows a schedule"),
    (lambda keras: keras.optimizers.Adam(amsgrad=True), r"^a dynamic embedding table cannot train with Keras' Adam "
                                                        r"\(amsgrad\): its rows train with SGD, Adagrad, Adam, Ftrl"),
    (lambda keras: keras.optimizers.RMSprop(), r"^a dynamic embedding table cannot train with Keras' RMSprop"),
])
def test_what_a_table_cannot_train_with_is_named(optimizer, message):
    import keras
    with pytest.raises(ptf.ModelError, match=message):
        rule_for(optimizer(keras))
