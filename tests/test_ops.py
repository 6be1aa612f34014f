"""The compiled ops against a NumPy/Python reference of their definition (parallax_tf/ops)."""
import numpy as np
import pytest
import tensorflow as tf

from parallax_tf import ops

MASK = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def explore_reference(core, n: int, count: int, seed: int, round_index: int) -> np.ndarray:
    """Floyd's sampling of `count` positions of the complement, draw k from stream (seed, round)."""
    key = splitmix64((seed ^ splitmix64((round_index & MASK) ^ 0xD1B54A32D192ED03)) & MASK)
    m = n - len(core)
    chosen = []
    for k, j in enumerate(range(m - count, m)):
        t = splitmix64((key + k) & MASK) % (j + 1)
        chosen.append(j if t in chosen else t)
    complement = np.setdiff1d(np.arange(n), core)
    return complement[np.sort(np.array(chosen, dtype=np.int64))].astype(np.int32)


def core_reference(weights, update, lam, core_size) -> np.ndarray:
    score = np.abs(weights.reshape(-1)) + weights.dtype.type(lam) * np.abs(update.reshape(-1))
    order = np.lexsort((np.arange(score.size), -score))      # larger score, then lower index
    return np.sort(order[:core_size]).astype(np.int32)


def run(build):
    """Runs what `build` makes in a fresh graph."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        return sess.run(build())


@pytest.mark.parametrize("dtype", (np.float32, np.float64))
@pytest.mark.parametrize("lam", (0.0, 0.7))
def test_core_and_explored_sets_match_the_reference(dtype, lam):
    rng = np.random.RandomState(5)
    weights = rng.randn(40, 25).astype(dtype)
    update = rng.randn(40, 25).astype(dtype)
    weights[3, :5] = 2.5         # ties: the lower indices win
    core, explored = run(lambda: ops.significance_select(weights, update, lam, 11, 4, 100, 60))
    want_core = core_reference(weights, update, lam, 100)
    np.testing.assert_array_equal(core, want_core)
    np.testing.assert_array_equal(explored, explore_reference(want_core, 1000, 60, 11, 4))
    assert not set(core) & set(explored)
    assert np.all(np.diff(explored) > 0) and explored.dtype == np.int32


def test_ties_break_by_lower_index():
    weights = np.array([1.0, 3.0, 3.0, 3.0, 0.5], np.float32)
    core, _ = run(lambda: ops.significance_select(weights, np.zeros(5, np.float32), 1.0, 0, 0, 2, 0))
    np.testing.assert_array_equal(core, [1, 2])


def test_explore_indices_draws_what_select_draws_and_rounds_differ():
    weights = np.random.RandomState(1).randn(5000).astype(np.float32)
    zeros = np.zeros_like(weights)

    def build():
        core, explored = ops.significance_select(weights, zeros, 1.0, 3, 9, 500, 250)
        return core, explored, ops.explore_indices(core, 5000, 3, 9, 250), ops.explore_indices(core, 5000, 3, 10, 250)
    core, explored, again, next_round = run(build)
    np.testing.assert_array_equal(again, explored)
    assert len(set(next_round) & set(explored)) < 100       # another round, another sample
    np.testing.assert_array_equal(next_round, explore_reference(core, 5000, 250, 3, 10))


def test_explored_sets_are_uniform_over_the_complement():
    core = np.arange(0, 100, 2, dtype=np.int32)               # even indices below 100
    counts = np.zeros(200)
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        round_index = tf.compat.v1.placeholder(tf.int64, [])
        drawn = ops.explore_indices(core, 200, 0, round_index, 30)
        for r in range(400):
            counts[sess.run(drawn, {round_index: r})] += 1
    assert counts[core].sum() == 0
    free = np.setdiff1d(np.arange(200), core)
    expected = 400 * 30 / free.size                            # 80 per index
    assert abs(counts[free].mean() - expected) < 1e-9
    assert counts[free].min() > expected * 0.6 and counts[free].max() < expected * 1.4


def test_edge_sizes():
    weights = np.random.RandomState(2).randn(7).astype(np.float32)
    zeros = np.zeros_like(weights)
    everything, nothing = run(lambda: ops.significance_select(weights, zeros, 1.0, 0, 0, 7, 0))
    np.testing.assert_array_equal(everything, np.arange(7))
    assert nothing.shape == (0,)
    core, explored = run(lambda: ops.significance_select(weights, zeros, 1.0, 0, 0, 0, 7))
    assert core.shape == (0,)
    np.testing.assert_array_equal(explored, np.arange(7))


@pytest.mark.parametrize("build,message", [
    (lambda: ops.significance_select(np.zeros(5, np.float32), np.zeros(4, np.float32), 1.0, 0, 0, 1, 1),
     "weights have 5 elements but update has 4"),
    (lambda: ops.significance_select(np.zeros(5, np.float32), np.zeros(5, np.float32), 1.0, 0, 0, 4, 2),
     "core_size 4 + explore_size 2 exceeds the 5 elements"),
    (lambda: ops.explore_indices(np.array([3, 1], np.int32), 5, 0, 0, 1), "core must be sorted, unique"),
    (lambda: ops.explore_indices(np.array([1, 9], np.int32), 5, 0, 0, 1), "in [0, 5)"),
])
def test_errors_name_what_is_wrong(build, message):
    with pytest.raises(tf.errors.InvalidArgumentError, match=message.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)").replace("+", r"\+")):
        run(build)


@pytest.mark.parametrize("n,core_size,count", [(1000, 100, 60), (200, 0, 200), (129, 64, 65), (64, 1, 0)])
def test_round_selection_is_core_and_explored_merged(n, core_size, count):
    core = np.sort(np.random.RandomState(n).choice(n, core_size, replace=False)).astype(np.int32)
    selected = run(lambda: ops.round_selection(core, n, 7, 3, count))
    want = np.sort(np.concatenate([core, explore_reference(core, n, count, 7, 3)]))
    np.testing.assert_array_equal(selected, want)
    assert selected.dtype == np.int32 and len(set(selected)) == core_size + count


@pytest.mark.parametrize("dtype", (np.float32, np.float64))
@pytest.mark.parametrize("shape", ([], [7], [3, 4], [2, 3, 5]))
def test_flat_scatter_update_writes_flat_positions_of_any_shape(dtype, shape):
    start = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    where = np.array([0] if not shape else [int(np.prod(shape)) - 1, 0, 2], np.int32)
    values = np.array([-1.5, 4.25, 9.0][:len(where)], dtype)
    want = start.copy().reshape(-1)
    want[where] = values
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        variable = tf.Variable(start, use_resource=True)
        sess.run(variable.initializer)
        sess.run(ops.flat_scatter_update(variable, where, values))
        np.testing.assert_array_equal(sess.run(variable), want.reshape(shape))


def test_flat_scatter_update_errors_write_nothing():
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        variable = tf.Variable(np.zeros([2, 3], np.float32), use_resource=True)
        sess.run(variable.initializer)
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"index 6 at position 1 is outside \[0, 6\)"):
            sess.run(ops.flat_scatter_update(variable, np.array([0, 6], np.int32), np.ones(2, np.float32)))
        np.testing.assert_array_equal(sess.run(variable), np.zeros([2, 3]))
        with pytest.raises(tf.errors.InvalidArgumentError, match="the variable holds float, the updates double"):
            sess.run(ops.flat_scatter_update(variable, np.array([0], np.int32), np.ones(1, np.float64)))
        with pytest.raises(tf.errors.InvalidArgumentError, match="vectors of one length"):
            sess.run(ops.flat_scatter_update(variable, np.array([0, 1], np.int32), np.ones(1, np.float32)))


def test_flat_scatter_update_leaves_a_read_taken_before_it_unchanged():
    """Written like a dense update: a value read earlier in the step still holds the old buffer."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        variable = tf.Variable(np.zeros([2, 2], np.float32), use_resource=True)
        sess.run(variable.initializer)
        before = variable.read_value()
        with tf.control_dependencies([before]):
            write = ops.flat_scatter_update(variable, np.array([3], np.int32), np.array([5.0], np.float32))
        with tf.control_dependencies([write]):
            after = variable.read_value()
        old, new = sess.run([before, after])
        np.testing.assert_array_equal(old, np.zeros([2, 2]))
        np.testing.assert_array_equal(new, [[0, 0], [0, 5]])
