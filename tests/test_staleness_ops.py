"""ParallaxStaleApply and ParallaxVersionedRead (parallax_tf/ops/staleness_ops.cc): a push with a
given staleness gives exactly the scaled update of TF's own SGD, Momentum, Adagrad and Adam; versions
advance once per push, also when pushes race."""
import threading

import numpy as np
import pytest
import tensorflow as tf

from parallax_tf import ops

# float32 values, as TF's optimizers hold their Python-float hyperparameters (cast to the
# variable's type when applying)
HYPER = {"momentum": np.float32(0.9), "beta1": np.float32(0.9), "beta2": np.float32(0.999), "epsilon": np.float32(1e-8)}
SLOTS = {"sgd": 0, "momentum": 1, "nesterov": 1, "adagrad": 1, "adam": 2}
ADAGRAD_INITIAL = 0.1     # tf.compat.v1.train.AdagradOptimizer's initial_accumulator_value


def tf_optimizer(kind: str, lr: float):
    train = tf.compat.v1.train
    return {"sgd": lambda: train.GradientDescentOptimizer(lr),
            "momentum": lambda: train.MomentumOptimizer(lr, HYPER["momentum"]),
            "nesterov": lambda: train.MomentumOptimizer(lr, HYPER["momentum"], use_nesterov=True),
            "adagrad": lambda: train.AdagradOptimizer(lr, ADAGRAD_INITIAL),
            "adam": lambda: train.AdamOptimizer(lr, HYPER["beta1"], HYPER["beta2"], HYPER["epsilon"])}[kind]()


def with_tf_optimizer(kind, lr, w0, pushes, sparse):
    """What TF's own optimizer makes of the pushes (each a gradient, or (rows, values))."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        w = tf.Variable(w0, use_resource=True)
        g = tf.compat.v1.placeholder(w0.dtype, [None, w0.shape[1]] if sparse else w0.shape)
        rows = tf.compat.v1.placeholder(tf.int64, [None])
        grad = tf.IndexedSlices(g, rows, tf.constant(w0.shape, tf.int64)) if sparse else g
        step = tf_optimizer(kind, lr).apply_gradients([(grad, w)])
        sess.run(tf.compat.v1.global_variables_initializer())
        for push in pushes:
            sess.run(step, {g: push[1], rows: push[0]} if sparse else {g: push})
        return sess.run(w)


def with_stale_apply(kind, lr, w0, pushes, sparse, copy_versions, rule="inverse", gamma=0.9):
    """The same pushes through the op, push i computed on a copy of version copy_versions[i].
    Returns (final w, [(tau, version after)])."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        w = tf.Variable(w0, use_resource=True)
        start = ADAGRAD_INITIAL if kind == "adagrad" else 0.0
        slots = [tf.Variable(np.full_like(w0, start), use_resource=True) for _ in range(SLOTS[kind])]
        powers = [tf.Variable(HYPER["beta1"], use_resource=True),     # float32, as TF's Adam keeps them
                  tf.Variable(HYPER["beta2"], use_resource=True)] if kind == "adam" else []
        version = tf.Variable(np.int64(0), use_resource=True)
        g = tf.compat.v1.placeholder(w0.dtype, [None, w0.shape[1]] if sparse else w0.shape)
        rows = tf.compat.v1.placeholder(tf.int64, [None])
        copy = tf.compat.v1.placeholder(tf.int64, [])
        optimizer = "momentum" if kind == "nesterov" else kind
        push = ops.stale_apply(version, copy, np.float32(lr), [w], slots, powers, [g], [rows if sparse else None], optimizer,
                               rule=rule, gamma=gamma, use_nesterov=kind == "nesterov", **HYPER)
        sess.run(tf.compat.v1.global_variables_initializer())
        out = []
        for p, v in zip(pushes, copy_versions):
            feed = {g: p[1], rows: p[0], copy: v} if sparse else {g: p, copy: v}
            out.append(tuple(int(x) for x in sess.run(push, feed)))
        return sess.run(w), out


def make_pushes(sparse, n=3, seed=0, dtype=np.float64):
    rng = np.random.RandomState(seed)
    w0 = rng.randn(6, 4).astype(dtype)
    if sparse:
        pushes = [(np.sort(rng.choice(6, 3, replace=False)).astype(np.int64), rng.randn(3, 4).astype(dtype))
                  for _ in range(n)]
    else:
        pushes = [rng.randn(6, 4).astype(dtype) for _ in range(n)]
    return w0, pushes


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("kind", ["sgd", "momentum", "nesterov", "adagrad", "adam"])
def test_fresh_pushes_equal_tf_optimizer(kind, sparse):
    """tau = 0 every time: the op is TF's own optimizer (same update rule, same slots)."""
    w0, pushes = make_pushes(sparse)
    expected = with_tf_optimizer(kind, 0.1, w0, pushes, sparse)
    got, record = with_stale_apply(kind, 0.1, w0, pushes, sparse, copy_versions=[0, 1, 2])
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    assert record == [(0, 1), (0, 2), (0, 3)]


@pytest.mark.parametrize("rule,scale", [("inverse", lambda tau: 1 / max(1, tau)), ("exp", lambda tau: 0.5 ** tau),
                                        ("none", lambda tau: 1.0)])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("kind", ["sgd", "momentum", "adagrad", "adam"])
def test_stale_push_is_the_update_with_scaled_learning_rate(kind, sparse, rule, scale):
    """Three pushes computed on the version-0 copy have tau 0, 1, 2: each is TF's update with
    lr * scale(tau) (checked push by push against TF's optimizer at that learning rate)."""
    w0, pushes = make_pushes(sparse, seed=1)
    copies = [0, 0, 0]
    got, record = with_stale_apply(kind, 0.1, w0, pushes, sparse, copy_versions=copies, rule=rule, gamma=0.5)
    taus = [tau for tau, _ in record]
    assert taus == [0, 1, 2] and [v for _, v in record] == [1, 2, 3]
    # TF's optimizer with a learning-rate tensor per push reproduces the scaled updates
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        w = tf.Variable(w0, use_resource=True)
        lr = tf.compat.v1.placeholder(tf.float64, [])
        g = tf.compat.v1.placeholder(tf.float64, [None, 4] if sparse else [6, 4])
        rows = tf.compat.v1.placeholder(tf.int64, [None])
        grad = tf.IndexedSlices(g, rows, tf.constant([6, 4], tf.int64)) if sparse else g
        step = tf_optimizer(kind, lr).apply_gradients([(grad, w)])
        sess.run(tf.compat.v1.global_variables_initializer())
        for push, tau in zip(pushes, taus):
            feed = {g: push[1], rows: push[0]} if sparse else {g: push}
            sess.run(step, {**feed, lr: np.float64(np.float32(0.1)) * scale(tau)})
        expected = sess.run(w)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    assert not np.allclose(got, with_stale_apply(kind, 0.1, w0, pushes, sparse, [0, 1, 2], rule="none")[0]) \
        or rule == "none"


def test_float32_variables():
    w0, pushes = make_pushes(False, dtype=np.float32)
    got, _ = with_stale_apply("adam", 0.01, w0, pushes, False, [0, 1, 2])
    np.testing.assert_allclose(got, with_tf_optimizer("adam", 0.01, w0, pushes, False), rtol=1e-6, atol=1e-6)


def test_racing_pushes_each_get_their_own_version():
    """8 threads push 25 times each into one variable: every push is applied exactly once, the
    versions handed out are exactly 1..200, and w is w0 minus every push."""
    with tf.Graph().as_default():
        w = tf.Variable(np.zeros(1000), use_resource=True)
        version = tf.Variable(np.int64(0), use_resource=True)
        g = tf.compat.v1.placeholder(tf.float64, [1000])
        push = ops.stale_apply(version, 0, 1.0, [w], [], [], [g], [None], "sgd", rule="none")
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=8)
        with tf.compat.v1.Session(config=config) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            versions, lock = [], threading.Lock()

            def worker(k):
                for _ in range(25):
                    _, after = sess.run(push, {g: np.full(1000, float(k + 1))})
                    with lock:
                        versions.append(int(after))
            threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            final, v = sess.run([w, version])
    assert sorted(versions) == list(range(1, 201)) and v == 200
    np.testing.assert_array_equal(final, np.full(1000, -25.0 * sum(range(1, 9))))


def test_versioned_read_returns_values_at_their_version():
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        w = tf.Variable(np.ones(3), use_resource=True)
        b = tf.Variable(np.float32(2), use_resource=True)
        version = tf.Variable(np.int64(0), use_resource=True)
        push = ops.stale_apply(version, 0, 1.0, [w], [], [], [np.ones(3)], [None], "sgd", rule="none")
        read = ops.versioned_read(version, [w, b])
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(push)
        v, (wv, bv) = sess.run(read)
    assert v == 1 and wv.tolist() == [0.0, 0.0, 0.0] and bv == np.float32(2) and wv.dtype == np.float64


def test_copy_newer_than_the_global_version_is_refused():
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        w = tf.Variable(np.ones(3), use_resource=True)
        version = tf.Variable(np.int64(2), use_resource=True)
        push = ops.stale_apply(version, 5, 1.0, [w], [], [], [np.ones(3)], [None], "sgd")
        sess.run(tf.compat.v1.global_variables_initializer())
        with pytest.raises(tf.errors.InvalidArgumentError, match="copy has version 5, newer than the global version 2"):
            sess.run(push)


def test_sparse_row_out_of_range_is_refused():
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        w = tf.Variable(np.ones((4, 2)), use_resource=True)
        version = tf.Variable(np.int64(0), use_resource=True)
        push = ops.stale_apply(version, 0, 1.0, [w], [], [], [np.ones((1, 2))], [np.array([4])], "sgd")
        sess.run(tf.compat.v1.global_variables_initializer())
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"index 4 outside \[0, 4\)"):
            sess.run(push)


def test_wrong_slot_count_is_refused():
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        w = tf.Variable(np.ones(3), use_resource=True)
        version = tf.Variable(np.int64(0), use_resource=True)
        push = ops.stale_apply(version, 0, 1.0, [w], [], [], [np.ones(3)], [None], "momentum")
        sess.run(tf.compat.v1.global_variables_initializer())
        with pytest.raises(tf.errors.InvalidArgumentError, match="momentum needs 1 slot"):
            sess.run(push)
