"""ParallaxInputStash and its put / take / size / batches ops (parallax_tf/ops/stash_ops.cc): the
input stash of a DSP pipeline stage hands back exactly what was stored for a batch, in the order a
Python FIFO would, and refuses loudly (changing nothing) when the schedule asks for another batch."""
import collections

import numpy as np
import pytest
import tensorflow as tf

from parallax_tf import ops


def make_inputs(n, seed=0):
    """n batches of a stage input: a float32 [3, 5] activation and an int64 [4] id vector."""
    rng = np.random.RandomState(seed)
    return [(rng.randn(3, 5).astype(np.float32), rng.randint(-10**12, 10**12, size=4).astype(np.int64))
            for _ in range(n)]


class Stage:
    """One graph and session with a stash of capacity `capacity`, fed through placeholders."""

    def __init__(self, capacity=5, stage=2, shared_name="stash_test", graph=None, target=""):
        self.graph = graph or tf.Graph()
        with self.graph.as_default():
            self.x = tf.compat.v1.placeholder(tf.float32, [3, 5])
            self.ids = tf.compat.v1.placeholder(tf.int64, [4])
            self.batch = tf.compat.v1.placeholder(tf.int64, [])
            self.handle = ops.input_stash([tf.float32, tf.int64], capacity, stage, shared_name)
            self.put_op = ops.stash_put(self.handle, self.batch, [self.x, self.ids])
            self.take_op = ops.stash_take(self.handle, self.batch, [self.x, self.ids])
            self.batches_op = ops.stash_batches(self.handle)
            self.size_op = ops.stash_size(self.handle)
        self.sess = tf.compat.v1.Session(target, graph=self.graph)

    def put(self, batch, values):
        self.sess.run(self.put_op, {self.batch: batch, self.x: values[0], self.ids: values[1]})

    def take(self, batch):
        return self.sess.run(self.take_op, {self.batch: batch})

    def batches(self):
        return self.sess.run(self.batches_op).tolist()

    def size(self):
        return int(self.sess.run(self.size_op))

    def close(self):
        self.sess.close()


@pytest.fixture
def stage():
    s = Stage()
    yield s
    s.close()


def assert_same(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_array_equal(g, e)


def test_take_shapes_and_dtypes_come_from_like(stage):
    x, ids = stage.take_op
    assert x.dtype == tf.float32 and x.shape.as_list() == [3, 5]
    assert ids.dtype == tf.int64 and ids.shape.as_list() == [4]
    assert stage.batches_op.dtype == tf.int64 and stage.size_op.shape.rank == 0


def test_put_then_take_in_order(stage):
    inputs = make_inputs(5)
    for b, values in enumerate(inputs):
        stage.put(b, values)
    assert stage.batches() == [0, 1, 2, 3, 4] and stage.size() == 5
    for b, values in enumerate(inputs):
        assert_same(stage.take(b), values)
    assert stage.batches() == [] and stage.size() == 0


@pytest.mark.parametrize("staleness", [1, 4])
def test_dsp_schedule_matches_a_python_fifo(staleness):
    """A stage of DSP with `staleness` batches between a batch's forward and its backward: forward
    of b stores b's input, backward of b - staleness takes its own; then the pipeline drains."""
    stage = Stage(capacity=staleness + 1)
    inputs = make_inputs(12, seed=staleness)
    reference = collections.deque()
    order = []
    for b in range(len(inputs)):
        order.append(("put", b))
        if b >= staleness:
            order.append(("take", b - staleness))
    order += [("take", b) for b in range(len(inputs) - staleness, len(inputs))]
    for kind, b in order:
        if kind == "put":
            stage.put(b, inputs[b])
            reference.append((b, inputs[b]))
        else:
            expected_batch, expected = reference.popleft()
            assert expected_batch == b
            assert_same(stage.take(b), expected)
        assert stage.batches() == [batch for batch, _ in reference]
        assert len(reference) <= staleness + 1
    assert stage.batches() == [] and stage.size() == 0
    stage.close()


def test_take_of_another_batch_fails_and_keeps_the_stash(stage):
    inputs = make_inputs(3)
    for b, values in enumerate(inputs):
        stage.put(b, values)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"stage 2: backward of batch 1 needs its stored input, but the oldest stored input is "
                             r"of batch 0 \(stored: \[0, 1, 2\]\); the pipeline schedule is broken"):
        stage.take(1)
    assert stage.batches() == [0, 1, 2]
    assert_same(stage.take(0), inputs[0])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"oldest stored input is of batch 1 \(stored: \[1, 2\]\)"):
        stage.take(0)
    assert stage.batches() == [1, 2]


def test_take_on_empty_fails(stage):
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"(?m)^stage 2: backward of batch 7 needs its stored input, but no input is stored"):
        stage.take(7)
    stage.put(0, make_inputs(1)[0])
    stage.take(0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="backward of batch 0 needs its stored input, but no input"):
        stage.take(0)


def test_put_over_capacity_fails():
    stage = Stage(capacity=2, stage=0)
    inputs = make_inputs(3)
    stage.put(10, inputs[0])
    stage.put(11, inputs[1])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"(?m)^stage 0: cannot store the input of batch 12: the stash is full \(capacity 2, "
                             r"stored 2: \[10, 11\]\)"):
        stage.put(12, inputs[2])
    assert stage.batches() == [10, 11]
    assert_same(stage.take(10), inputs[0])
    stage.put(12, inputs[2])          # room again once backward took one
    assert stage.batches() == [11, 12]
    stage.close()


@pytest.mark.parametrize("second", [3, 2])
def test_put_of_a_batch_not_after_the_last_fails(stage, second):
    inputs = make_inputs(2)
    stage.put(3, inputs[0])
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"(?m)^stage 2: cannot store the input of batch {second}: batches must increase, and "
                             r"batch 3 was stored before"):
        stage.put(second, inputs[1])
    assert stage.batches() == [3]


def test_batch_ids_must_increase_across_takes(stage):
    """Batch 0 taken, stash empty: storing batch 0 again is still a schedule bug."""
    inputs = make_inputs(2)
    stage.put(0, inputs[0])
    stage.take(0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="batches must increase, and batch 0 was stored before"):
        stage.put(0, inputs[1])


def test_take_built_for_other_dtypes_fails(stage):
    with stage.graph.as_default():
        wrong = ops.stash_take(stage.handle, stage.batch, [tf.zeros([3, 5], tf.float64)])
    stage.put(0, make_inputs(1)[0])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"(?m)^stage 2: the stash holds \[float, int64\], "
                                                             r"the op was built for \[double\]"):
        stage.sess.run(wrong, {stage.batch: 0})
    assert stage.batches() == [0]


def test_different_shared_names_are_independent():
    graph = tf.Graph()
    a = Stage(shared_name="stash_a", graph=graph)
    b = Stage(shared_name="stash_b", graph=graph)
    b.sess.close()
    b.sess = a.sess                      # one session, two stashes
    inputs = make_inputs(3)
    a.put(0, inputs[0])
    a.put(1, inputs[1])
    b.put(5, inputs[2])
    assert a.batches() == [0, 1] and b.batches() == [5]
    assert_same(b.take(5), inputs[2])
    assert a.batches() == [0, 1] and b.batches() == []
    assert_same(a.take(0), inputs[0])
    a.close()


def test_same_shared_name_in_one_session_is_one_stash():
    graph = tf.Graph()
    a = Stage(shared_name="stash_same", graph=graph)
    b = Stage(shared_name="stash_same", graph=graph)
    b.sess.close()
    b.sess = a.sess
    inputs = make_inputs(2)
    a.put(0, inputs[0])
    b.put(1, inputs[1])
    assert a.batches() == [0, 1] == b.batches()
    assert_same(b.take(0), inputs[0])
    assert_same(a.take(1), inputs[1])
    a.close()


def test_same_shared_name_is_shared_by_two_graphs_on_one_server():
    """The forward graph stores and the backward graph, built separately, takes from the same stash
    (both sessions on one in-process server, whose device resource manager they share)."""
    server = tf.distribute.Server.create_local_server()
    forward = Stage(shared_name="stash_server", target=server.target)
    backward = Stage(shared_name="stash_server", target=server.target)
    inputs = make_inputs(2)
    forward.put(0, inputs[0])
    forward.put(1, inputs[1])
    assert backward.batches() == [0, 1]
    assert_same(backward.take(0), inputs[0])
    assert forward.batches() == [1]
    with pytest.raises(tf.errors.InvalidArgumentError, match="oldest stored input is of batch 1"):
        backward.take(2)
    forward.close()
    backward.close()


def test_shared_stash_with_another_capacity_is_refused():
    graph = tf.Graph()
    a = Stage(capacity=5, shared_name="stash_capacity", graph=graph)
    b = Stage(capacity=3, shared_name="stash_capacity", graph=graph)
    b.sess.close()
    b.sess = a.sess
    a.put(0, make_inputs(1)[0])
    with pytest.raises(tf.errors.InvalidArgumentError, match="has capacity 5, this op asks for 3"):
        b.batches()
    a.close()
