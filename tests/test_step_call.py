"""A synchronous step runs through TF's callable (parallax_tf/runtime/step_call.py): the same
values as session.run for the runner's fetch structures and feeds (a fed tensor fetched, a
variable), errors named by their op, the step's deadline, and a traced step's trace."""
import numpy as np
import pytest
import tensorflow as tf

from parallax_tf.runtime.step_call import StepCall


@pytest.fixture
def step():
    graph = tf.Graph()
    with graph.as_default():
        ids = tf.compat.v1.placeholder(tf.int64, [None], name="ids")
        words = tf.compat.v1.placeholder(tf.string, [None], name="words")
        weight = tf.compat.v1.placeholder(tf.float32, [None], name="weight")      # fed integers
        request = tf.compat.v1.placeholder_with_default(tf.constant(0.0, tf.float64), [], name="request")
        total = tf.Variable(0.0, dtype=tf.float64)
        loss = tf.reduce_sum(tf.cast(ids, tf.float64)) + tf.reduce_sum(tf.cast(tf.strings.length(words), tf.float64)) \
            + tf.reduce_sum(tf.cast(weight, tf.float64)) + request
        train = tf.compat.v1.assign_add(total, loss).op
        fetches = {"loss": loss, "train": train, "bytes": {"b": tf.size(ids), "a": tf.shape(words), "fed": request},
                   "again": loss, "extra": [train, total.read_value()]}
        feeds = {ids: np.arange(4), words: np.array(["a", "bb", "ccc", ""], dtype=object), weight: [1, 2, 3, 4],
                 request: 5.0}
        session = tf.compat.v1.Session(graph=graph)
        session.run(total.initializer)
        yield session, fetches, feeds
        session.close()


def test_a_step_through_the_callable_gives_what_session_run_gives(step):
    session, fetches, feeds = step
    call = StepCall(session, timeout_ms=10_000)
    got = call.run(fetches, feeds)
    want = session.run(fetches, feeds)
    assert got["loss"] == want["loss"] == 6 + 6 + 10 + 5
    assert got["again"] == got["loss"] and got["train"] is None and got["extra"][0] is None
    assert got["bytes"]["b"] == 4 and list(got["bytes"]["a"]) == [4]
    assert got["bytes"]["fed"] == want["bytes"]["fed"] == 5.0      # a fed tensor fetched: its fed value
    # each run applied its update once: session.run's after the callable's
    assert session.run(fetches["extra"][1]) == 2 * 27
    assert call.run(fetches, feeds)["loss"] == 27 and len(call._made) == 1    # made once for these feeds and fetches
    assert call.run(fetches, {k: v for k, v in feeds.items() if k.op.name != "request"})["loss"] == 22
    assert len(call._made) == 2


def test_a_variable_fetched_reads_its_value_as_in_session_run(step):
    session, fetches, feeds = step
    total = session.graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)[0]
    out = StepCall(session, timeout_ms=10_000).run({"total": total, "train": fetches["train"]}, feeds)
    assert out["total"] in (0.0, 27.0) and session.run(total) == 27.0


def test_an_error_names_its_op_as_session_run_does(step):
    session, fetches, feeds = step
    graph = session.graph
    with graph.as_default():
        checked = tf.debugging.check_numerics(tf.math.log(fetches["loss"] - 1000.0), "loss went wrong", name="checked")
    with pytest.raises(tf.errors.InvalidArgumentError, match="loss went wrong") as raised:
        StepCall(session, timeout_ms=10_000).run({"checked": checked}, feeds)
    assert raised.value.op is not None and raised.value.op.name == "checked"


def test_a_step_that_never_completes_ends_at_its_deadline(step):
    session, _, _ = step
    with session.graph.as_default():
        queue = tf.queue.FIFOQueue(1, tf.float32)
        waits = queue.dequeue(name="waits_forever")
    with pytest.raises(tf.errors.DeadlineExceededError):
        StepCall(session, timeout_ms=300).run({"value": waits}, {})


def test_a_traced_step_returns_its_trace(step):
    session, fetches, feeds = step
    metadata = tf.compat.v1.RunMetadata()
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE, timeout_in_ms=10_000)
    out = StepCall(session, timeout_ms=10_000).run(fetches, feeds, options=options, run_metadata=metadata)
    assert out["loss"] == 27 and len(metadata.step_stats.dev_stats) > 0
