"""A tf.data pipeline built inside model_fn is read by the ranks in turn: rank r of N reads
batches r, r+N, ...; N real ranks then train exactly as one device on N consecutive batches,
and --noshard_input gives every rank the whole pipeline."""
import os
import tempfile

import numpy as np
import pytest
import tensorflow as tf

import parallax_tf as ptf
from parallax_tf import input_shard, model_init, training_graph
from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.model import RunContext
from tests import cases, launch, reference

ROWS, BATCH = 64, 2


def _dataset(v1: bool = True):
    """Batch k holds rows 2k and 2k+1: a batch's first value / BATCH is its index."""
    source = tf.compat.v1.data.Dataset if v1 else tf.data.Dataset
    return source.from_tensor_slices(np.arange(ROWS, dtype=np.float32)[:, None]).batch(BATCH).prefetch(1)


def _reinitializable():
    ds = _dataset()
    iterator = tf.compat.v1.data.Iterator.from_structure(tf.compat.v1.data.get_output_types(ds),
                                                         tf.compat.v1.data.get_output_shapes(ds))
    tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.TABLE_INITIALIZERS, iterator.make_initializer(ds))
    return iterator


def _raw_iterator():
    """An iterator made from raw ops, past every path that could shard it."""
    ds = _dataset(v1=False)
    types, shapes = [tf.float32], [tf.TensorShape([None, 1])]
    resource = tf.raw_ops.IteratorV2(shared_name="", container="", output_types=types, output_shapes=shapes,
                                     name="raw_iterator")
    tf.raw_ops.MakeIterator(dataset=tf.data.experimental.to_variant(ds), iterator=resource)
    return tf.raw_ops.IteratorGetNext(iterator=resource, output_types=types, output_shapes=shapes)[0]


ITERATORS = {
    "make_one_shot_iterator": lambda: tf.compat.v1.data.make_one_shot_iterator(_dataset()).get_next(),
    "make_initializable_iterator": lambda: tf.compat.v1.data.make_initializable_iterator(_dataset()).get_next(),
    "v2_dataset": lambda: tf.compat.v1.data.make_one_shot_iterator(_dataset(v1=False)).get_next(),
    "Dataset.make_one_shot_iterator": lambda: _dataset().make_one_shot_iterator().get_next(),
    "Dataset.make_initializable_iterator": lambda: _dataset().make_initializable_iterator().get_next(),
    "make_initializer": lambda: _reinitializable().get_next(),
    "opted_out": lambda: tf.compat.v1.data.make_one_shot_iterator(_dataset().with_options(_no_auto_shard())).get_next(),
    "raw": _raw_iterator,
}


def _no_auto_shard():
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return options


def _build(make, rank, size, shard=True):
    """Builds a model reading `make()`'s batches; returns (graph, the batch tensor, the train op)."""
    graph, seen = tf.Graph(), {}

    def model_fn(ctx):
        seen["x"] = make()
        w = tf.compat.v1.get_variable("w", [1, 1])
        return ptf.Model(loss=tf.reduce_mean(tf.matmul(seen["x"], w)),
                         optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))
    with graph.as_default():
        training = training_graph.build(model_fn, RunContext(rank=rank, size=size), shard=shard)
    return graph, seen["x"], training.train_op


def _batches_read(make, rank, size, shard=True, count=4, skip=0):
    """Indices of the batches the step reads, after `skip` reads (what a resume at step `skip` runs)."""
    graph, x, train_op = _build(make, rank, size, shard)
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        sess.run(model_init.initializers(graph, [train_op]))
        for _ in range(skip):
            sess.run(model_init.input_reads(graph, [train_op]))
        return [int(sess.run(x)[0, 0]) // BATCH for _ in range(count)]


@pytest.mark.parametrize("path", [p for p in ITERATORS if p not in ("opted_out", "raw")])
def test_each_rank_reads_every_nth_batch(path):
    assert _batches_read(ITERATORS[path], rank=1, size=3) == [1, 4, 7, 10]


def test_resume_continues_at_the_right_batch():
    """A resume at step S reads S batches of the shard first: rank r then reads batch S*N + r."""
    assert _batches_read(ITERATORS["make_initializable_iterator"], rank=1, size=3, skip=2, count=2) == [7, 10]


@pytest.mark.parametrize("rank,size,shard,path", [(0, 1, True, "make_one_shot_iterator"),
                                                  (1, 3, False, "make_one_shot_iterator"),
                                                  (1, 3, True, "opted_out"), (1, 3, True, "raw")])
def test_whole_pipeline_when_not_sharded(rank, size, shard, path):
    assert _batches_read(ITERATORS[path], rank=rank, size=size, shard=shard) == [0, 1, 2, 3]


def test_patches_are_undone_even_when_model_fn_fails():
    before = [vars(owner)[name] for owner, name in tf_shim.iterator_makers()]

    def failing(ctx):
        tf.compat.v1.data.make_one_shot_iterator(_dataset())
        raise RuntimeError("model_fn failed")
    with tf.Graph().as_default(), pytest.raises(RuntimeError, match="model_fn failed"):
        training_graph.build(failing, RunContext(rank=0, size=2))
    assert [vars(owner)[name] for owner, name in tf_shim.iterator_makers()] == before


def test_an_unshardable_iterator_is_said_once_on_rank_0(capsys, monkeypatch):
    monkeypatch.setattr(input_shard, "_WARNED", set())
    _build(_raw_iterator, rank=1, size=2)
    assert "warning" not in capsys.readouterr().err          # rank 1 says nothing
    for _ in range(2):                                        # inspection, then the rewrite
        _build(_raw_iterator, rank=0, size=2)
    lines = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert lines == ["parallax_tf: warning: the tf.data iterator 'raw_iterator' was not made by make_one_shot_iterator/"
                     "make_initializable_iterator, so it is not sharded: every rank reads the same batches"]
    _build(ITERATORS["make_one_shot_iterator"], rank=0, size=2)
    _build(_raw_iterator, rank=0, size=2, shard=False)
    assert "warning" not in capsys.readouterr().err          # sharded, or asked to read the whole


def _single_device(batch: int):
    """Plain TF: the job's model with batches of `batch` rows, trained for the job's steps."""
    from tests.jobs import input_shard_job as job
    graph = tf.Graph()
    with graph.as_default():
        model = job.model_fn(batch)
        train = cases.minimize(model.optimizer, model.loss)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for _ in range(job.STEPS):
                sess.run(train)
            return {v.op.name: sess.run(v) for v in tf.compat.v1.trainable_variables()}


def test_two_ranks_train_on_consecutive_batches_and_noshard_input_reads_the_whole_pipeline():
    from tests.jobs import input_shard_job as job
    out = tempfile.mkdtemp(prefix="ptf-input-shard-")
    proc = launch.run_ranks(2, ["tests/jobs/input_shard_job.py", out])
    assert proc.returncode == 0, launch.tail(proc)
    for mode, rows in (("sharded", 2 * job.BATCH), ("whole", job.BATCH)):
        ranks = [np.load(os.path.join(out, f"{mode}.rank{r}.npz")) for r in range(2)]
        want = _single_device(rows)     # sharded: two consecutive batches; whole: one batch, twice
        for name, value in want.items():
            error = reference.relative_error(ranks[0][f"var:{name}"], value)
            assert error <= 1e-5, f"{mode}/{name}: relative error {error:.2e}"
        same = np.array_equal(ranks[0]["losses"], ranks[1]["losses"])
        assert same == (mode == "whole"), f"{mode}: rank losses {ranks[0]['losses']} and {ranks[1]['losses']}"
