"""Every mistake a user can make gets one clear message and a non-zero exit, never a hang."""
import re
import socket
import time

import numpy as np
import pytest
import tensorflow as tf

import parallax_tf as ptf
from tests import cases, launch


def _run_plan_only(model_fn, input_fn=None, **kw):
    return ptf.run(model_fn, input_fn, plan_only=True, **kw)


def _emb_model(loss_fn=None, optimizer=True, extra=None):
    def model_fn():
        ids = tf.compat.v1.placeholder(tf.int64, [None, 3], name="ids")
        emb = tf.compat.v1.get_variable("emb", [10, 2])
        rows = tf.compat.v1.nn.embedding_lookup(emb, ids)
        if extra:
            extra(emb)
        loss = loss_fn(rows) if loss_fn else tf.reduce_mean(rows)
        return ptf.Model(loss=loss, optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1) if optimizer else None)
    return model_fn


FEEDS = lambda ctx: {"ids": np.zeros([2, 3], np.int64)}  # noqa: E731


def test_no_loss():
    with pytest.raises(ptf.ModelError, match="no loss"):
        _run_plan_only(lambda: ptf.Model(loss=None, optimizer=tf.compat.v1.train.AdamOptimizer()))


def test_no_optimizer():
    with pytest.raises(ptf.ModelError, match="no optimizer"):
        _run_plan_only(_emb_model(optimizer=False), FEEDS)


def test_non_scalar_loss():
    with pytest.raises(ptf.ModelError, match=r"shape \(None, 3, 2\).*must be a scalar"):
        _run_plan_only(_emb_model(loss_fn=lambda rows: rows), FEEDS)


def test_returns_something_else():
    with pytest.raises(ptf.ModelError, match="return parallax_tf.Model"):
        _run_plan_only(lambda: tf.constant(1.0))


def test_no_trainable_variables():
    def model_fn():
        x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
        return ptf.Model(loss=tf.reduce_mean(x), optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))
    with pytest.raises(ptf.ModelError, match="no trainable variables"):
        _run_plan_only(model_fn, lambda ctx: {"x": np.ones(2, np.float32)})


def test_variable_changed_outside_optimizer_is_named():
    model_fn = _emb_model(extra=lambda emb: emb.assign_add(tf.ones_like(emb)))
    with pytest.raises(ptf.ModelError, match="variable 'emb' is changed outside the optimizer"):
        _run_plan_only(model_fn, FEEDS)


def test_input_fn_missing_placeholder_is_named():
    with pytest.raises(ptf.InputError, match=r"did not provide placeholder\(s\) \['labels'\]"):
        _run_plan_only(cases.build("mixed", "sgd"), lambda ctx: {"ids": np.zeros([2, 3], np.int64)})


def test_no_input_fn_but_placeholders():
    with pytest.raises(ptf.InputError, match="no input_fn was given"):
        _run_plan_only(cases.build("mixed", "sgd"))


def test_unknown_strategy():
    with pytest.raises(ptf.ConfigError, match="unknown strategy 'bogus'; choose one of hybrid, ps, allreduce, collective, auto"):
        _run_plan_only(cases.build("mixed", "sgd"), cases.input_fn_for("mixed"), strategy="bogus")


def test_np_below_one():
    with pytest.raises(ptf.ConfigError, match="--np must be at least 1, got 0"):
        _run_plan_only(cases.build("mixed", "sgd"), cases.input_fn_for("mixed"), np=0)


def _mixed_parts():
    loss = cases._mixed_loss()
    return loss, tf.compat.v1.train.GradientDescentOptimizer(0.1)


def test_train_op_without_an_optimizer_apply():
    def model_fn():
        loss, _ = _mixed_parts()
        return ptf.Model(loss=loss, train_op=tf.compat.v1.assign_add(tf.compat.v1.train.get_or_create_global_step(), 1))
    with pytest.raises(ptf.ModelError, match="runs no optimizer apply: build it with opt.minimize"):
        _run_plan_only(model_fn, cases.input_fn_for("mixed"))


def test_two_optimizers_over_one_variable():
    def model_fn():
        loss, sgd = _mixed_parts()
        adam = tf.compat.v1.train.AdamOptimizer(0.1)
        return ptf.Model(loss=loss, train_op=tf.group(sgd.minimize(loss), adam.minimize(loss)))
    with pytest.raises(ptf.ModelError, match=r"variable 'emb' is updated by two optimizer applies \(GradientDescentOptimizer"):
        _run_plan_only(model_fn, cases.input_fn_for("mixed"))


def test_both_optimizer_and_train_op():
    def model_fn():
        loss, sgd = _mixed_parts()
        return ptf.Model(loss=loss, optimizer=sgd, train_op=sgd.minimize(loss))
    with pytest.raises(ptf.ModelError, match="both an optimizer and a train_op; pass one"):
        _run_plan_only(model_fn, cases.input_fn_for("mixed"))


def test_keras3_model_names_tf_keras_as_the_fix():
    def model_fn():
        import keras  # what tf.keras is in TF 2.21
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        loss = tf.reduce_mean(keras.layers.Dense(1)(x))
        return ptf.Model(loss=loss, optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))
    with pytest.raises(ptf.ModelError, match=r"Keras 3 object \(keras\.src\..*Use Keras 2: `import tf_keras`"):
        _run_plan_only(model_fn, lambda ctx: {"x": np.ones([2, 4], np.float32)})


@pytest.mark.parametrize("given", ["model", "function"])
def test_a_keras3_model_given_to_fit_trains_through_the_tf2_front_end(given):
    import keras

    def make():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="out")])
        model.compile("adam", "mse")
        return model
    history = ptf.fit(make() if given == "model" else make, np.ones([4, 4], np.float32), np.ones([4, 1], np.float32),
                      plan_only=True)
    trained = {v.name.split("/", 1)[1]: v.route for v in history.plan.trained}
    assert trained == {"out/bias": "allreduce", "out/kernel": "allreduce"}


def test_transform_that_cannot_be_distributed_names_the_op():
    proc = launch.run_ranks(1, ["tests/jobs/bad_input_job.py", "--case=sign_of_sparse_gradient", "--steps=2"],
                            launcher="python", timeout=180)
    assert proc.returncode == 2
    assert ("parallax_tf: error: gradient transform op 'Sign' (Sign) changes the rows of sparse PS variable 'emb' "
            "before its apply in a way that is not linear") in proc.stderr, launch.tail(proc)


# ---- the same mistakes as a user meets them: a script, real ranks, an exit status ----------

def test_missing_placeholder_on_two_ranks_exits_nonzero_with_message():
    start = time.time()
    proc = launch.run_ranks(1, ["tests/jobs/bad_input_job.py", "--case=missing_placeholder", "--np=2"],
                            launcher="python", timeout=180)
    assert proc.returncode == 2
    assert "parallax_tf: error: input_fn did not provide placeholder(s) ['labels']" in proc.stderr
    assert time.time() - start < 120


def test_unknown_strategy_flag_is_rejected_by_absl():
    proc = launch.run_ranks(1, ["tests/jobs/bad_input_job.py", "--strategy=bogus"], launcher="python", timeout=120)
    assert proc.returncode != 0
    from parallax_tf.strategy import names
    assert f"--strategy=bogus: value should be one of <{'|'.join(names())}>" in proc.stderr


def test_busy_port_moves_to_next_free_one():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        proc = launch.run_ranks(2, ["tests/jobs/bad_input_job.py", f"--port={port}", "--steps=3", "--log_every=0"],
                                timeout=180)
    assert proc.returncode == 0, launch.tail(proc)
    assert proc.stdout.count("trained global_step=3") == 2


def test_lost_rank_stops_the_job_with_a_message():
    start = time.time()
    proc = launch.run_ranks(2, ["tests/jobs/bad_input_job.py", "--die_at_step=2", "--steps=50", "--timeout_s=30"],
                            timeout=180)
    assert proc.returncode != 0
    assert "exit code: 17" in (proc.stdout + proc.stderr).lower()
    assert time.time() - start < 90


def test_ranks_waiting_in_different_collectives_stop_with_a_message():
    """TF cancels a step at --timeout_s but a Horovod collective ignores that: the watchdog
    stops a rank whose step or barrier outlives 2 x --timeout_s plus a margin (20 s at 5 s)."""
    start = time.time()
    proc = launch.run_ranks(2, ["tests/jobs/bad_input_job.py", "--rank1_skips_a_step", "--steps=4", "--timeout_s=5",
                                "--log_every=0"], timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert re.search(r"parallax_tf rank [01]: (step \d|collecting results) has not finished after 20s", output), \
        launch.tail(proc)
    assert time.time() - start < 150


def _dense_model(optimizer):
    def model_fn():
        x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="x")
        w = tf.compat.v1.get_variable("w", [2, 1])
        return ptf.Model(loss=tf.reduce_mean(tf.matmul(x, w)), optimizer=optimizer())
    return model_fn


def test_a_new_keras_optimizer_is_refused_naming_the_legacy_one():
    import tf_keras
    with pytest.raises(ptf.ModelError, match=r"optimizer is tf_keras Adam: the new Keras optimizers train nothing "
                                             r"in a tf.compat.v1 graph.*tf_keras.optimizers.legacy.Adam or "
                                             r"tf.compat.v1.train.AdamOptimizer"):
        _run_plan_only(_dense_model(lambda: tf_keras.optimizers.Adam(0.1)), lambda ctx: {"x": np.ones([2, 2])})


def test_a_new_keras_optimizer_in_the_users_own_train_op_gets_the_same_message():
    import tf_keras

    def model_fn():
        x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="x")
        layer = tf_keras.layers.Dense(1)
        loss = tf.reduce_mean(layer(x))
        optimizer = tf_keras.optimizers.Adagrad(0.1)
        grads = tf.gradients(loss, layer.trainable_variables)
        return ptf.Model(loss=loss, train_op=optimizer.apply_gradients(zip(grads, layer.trainable_variables)))
    with pytest.raises(ptf.ModelError, match=r"optimizer is tf_keras Adagrad: the new Keras optimizers train nothing "
                                             r".*tf_keras.optimizers.legacy.Adagrad or "
                                             r"tf.compat.v1.train.AdagradOptimizer"):
        _run_plan_only(model_fn, lambda ctx: {"x": np.ones([2, 2], np.float32)})


def test_a_legacy_keras_optimizer_is_taken():
    import tf_keras
    result = _run_plan_only(_dense_model(lambda: tf_keras.optimizers.legacy.Adam(0.1)),
                            lambda ctx: {"x": np.ones([2, 2], np.float32)})
    assert [v.name for v in result.plan.variables] == ["w"]


def _hand_made_gradient_model(optimizer, gradient):
    """w trained by `optimizer` from `gradient(x, w)`, a gradient not taken by tf.gradients."""
    def model_fn():
        x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
        w = tf.compat.v1.get_variable("w", [1])
        loss = tf.reduce_mean(tf.square(x * w - 1.0))
        return ptf.Model(loss=loss, train_op=optimizer().apply_gradients([(gradient(x, w), w)]))
    return model_fn


@pytest.mark.parametrize("optimizer, gradient, says", [
    ("tf_keras legacy SGD", lambda x, w: tf.reduce_mean(2.0 * (x * w - 1.0) * x, keepdims=True, name="by_hand"),
     "tensor 'by_hand:0'"),
    ("tf.compat.v1.train GradientDescentOptimizer",
     lambda x, w: tf.compat.v1.get_variable("g", [1], trainable=False), "the variable 'g'"),
], ids=["keras_by_hand", "v1_variable"])
def test_a_gradient_not_from_tf_gradients_is_named_as_the_user_built_it(optimizer, gradient, says):
    import tf_keras
    make = {"tf_keras legacy SGD": lambda: tf_keras.optimizers.legacy.SGD(0.1),
            "tf.compat.v1.train GradientDescentOptimizer": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1)}
    with pytest.raises(ptf.ModelError) as raised:
        _run_plan_only(_hand_made_gradient_model(make[optimizer], gradient), lambda ctx: {"x": np.ones(2, np.float32)})
    assert str(raised.value) == (
        f"variable 'w' is updated by {optimizer}.apply_gradients from {says}, which does not come from tf.gradients "
        "or optimizer.compute_gradients of a loss; parallax_tf must know the raw gradient to average it across "
        "ranks. Compute it with opt.compute_gradients(loss) or tf.gradients(loss, variables) (a transform such as "
        "clipping may follow)")


def _iterator_model(make_iterator):
    def model_fn():
        iterator = make_iterator(tf.data.Dataset.from_tensor_slices(np.ones([8, 2], np.float32)).batch(2))
        w = tf.compat.v1.get_variable("w", [2, 1])
        return ptf.Model(loss=tf.reduce_mean(tf.matmul(iterator.get_next(), w)),
                         optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))
    return model_fn


def test_a_feedable_iterator_is_refused():
    def feedable(dataset):
        handle = tf.compat.v1.placeholder(tf.string, [], name="handle")
        return tf.compat.v1.data.Iterator.from_string_handle(handle, tf.compat.v1.data.get_output_types(dataset),
                                                             tf.compat.v1.data.get_output_shapes(dataset))
    with pytest.raises(ptf.ModelError, match=r"feedable iterator .*from_string_handle.*make_initializable_iterator"):
        _run_plan_only(_iterator_model(feedable))


def test_a_reinitializable_iterator_with_two_datasets_is_refused():
    def reinitializable(dataset):
        iterator = tf.compat.v1.data.Iterator.from_structure(tf.compat.v1.data.get_output_types(dataset),
                                                             tf.compat.v1.data.get_output_shapes(dataset))
        iterator.make_initializer(dataset)
        iterator.make_initializer(dataset.skip(1))
        return iterator
    with pytest.raises(ptf.ModelError, match=r"has 2 initializers .*reinitializable iterator.*TABLE_INITIALIZERS"):
        _run_plan_only(_iterator_model(reinitializable))


def test_an_initializer_that_needs_a_feed_is_refused():
    def fed_iterator(dataset):
        rows = tf.compat.v1.placeholder(tf.float32, [None, 2], name="rows")
        return tf.compat.v1.data.make_initializable_iterator(tf.data.Dataset.from_tensor_slices(rows).batch(2))
    with pytest.raises(ptf.ModelError, match=r"initializer '.*' \(MakeIterator\) needs placeholder\(s\) \['rows'\] "
                                             r"fed; parallax_tf runs initializers without feeds"):
        _run_plan_only(_iterator_model(fed_iterator))


def test_sparse_feeds_in_either_form_and_their_batch_size():
    from parallax_tf.feeds import batch_size, make_feeds
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.sparse_placeholder(tf.int64, name="tags")
        tf.compat.v1.placeholder(tf.int64, [None], name="labels")
    needed = ["labels", "tags/indices", "tags/shape", "tags/values"]
    parts = {"tags/indices": np.array([[0, 0], [0, 1], [2, 0]]), "tags/values": np.array([4, 5, 6]),
             "tags/shape": np.array([3, 2]), "labels": np.array([0, 1, 2])}
    value = tf.compat.v1.SparseTensorValue(parts["tags/indices"], parts["tags/values"], parts["tags/shape"])
    eager = tf.SparseTensor(parts["tags/indices"], parts["tags/values"], parts["tags/shape"])
    for given in (parts, {"tags": value, "labels": parts["labels"]}, {"tags": eager, "labels": parts["labels"]}):
        feeds = make_feeds(lambda ctx: given, None, needed, graph)
        assert {t.name: v.tolist() for t, v in feeds.items()} == {f"{k}:0": v.tolist() for k, v in parts.items()}
        assert batch_size(feeds) == 3       # the dense shape's rows, not the 3 ids nor 2 columns


def test_ps_plus_names_a_legacy_keras_optimizer_it_cannot_apply():
    proc = launch.run_ranks(1, ["tests/jobs/equivalence_job.py", "/tmp", "ps_plus", "keras_momentum"], launcher="python")
    assert proc.returncode != 0
    assert "ps_plus applies pushes with its compiled op" in proc.stderr and "the model uses tf_keras legacy SGD" \
        in proc.stderr, launch.tail(proc)
