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


def _decided(make, size: int = 2):
    """(sharded, why) of each pipeline `make(ctx)` builds, as inspection decides on rank 0."""
    def build(ctx):
        with tf.Graph().as_default():
            tf.compat.v1.set_random_seed(0)

            def model_fn(ctx):
                w = tf.compat.v1.get_variable("w", [1, 1])
                return ptf.Model(loss=tf.reduce_mean(tf.matmul(make(ctx), w)),
                                 optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))
            return training_graph.build(model_fn, ctx).inputs
    return [(d.sharded, d.why) for d in input_shard.decide(build(RunContext(rank=0, size=size)), build)]


def _one_shot(ds):
    return tf.compat.v1.data.make_one_shot_iterator(ds).get_next()


def _rows():
    return tf.data.Dataset.from_tensor_slices(np.arange(ROWS, dtype=np.float32)[:, None])


def _generator():
    rows = np.arange(ROWS, dtype=np.float32)[:, None]
    return tf.data.Dataset.from_generator(lambda: iter(rows), output_signature=tf.TensorSpec([1], tf.float32))


DEPENDS = "it depends on ctx.rank (built for rank 1, it reads other data)"
INDEPENDENT = "it does not depend on the rank"
PIPELINE_FORMS = {
    "plain": (lambda ctx: _one_shot(_rows().batch(2)), True, INDEPENDENT),
    # the rank read for a metric after the pipeline was made changes nothing
    "rank_read_after": (lambda ctx: _one_shot(_rows().batch(2)) + 0.0 * ctx.rank, True, INDEPENDENT),
    # read before, but the pipeline is the same for every rank (functions, a seedless shuffle)
    "rank_read_before": (lambda ctx: (ctx.rank, _one_shot(_rows().map(lambda v: v * 2.0).shuffle(8).batch(2)))[1],
                         True, INDEPENDENT),
    "shard_by_ctx_after_batch": (lambda ctx: _one_shot(_rows().batch(2).shard(ctx.size, ctx.rank)), False,
                                 "it already holds a shard by the job's size (2)"),
    "shard_by_a_constant": (lambda ctx: _one_shot(_rows().shard(2, 0).batch(2)), False,
                            "it already holds a shard by the job's size (2)"),
    "data_by_rank": (lambda ctx: tf.compat.v1.data.make_initializable_iterator(
        tf.data.Dataset.from_tensor_slices(np.arange(ROWS, dtype=np.float32)[ctx.rank::ctx.size, None])
        .batch(2)).get_next(), False, DEPENDS),
    "file_by_rank": (lambda ctx: _one_shot(tf.data.Dataset.from_tensor_slices(
        tf.strings.to_number([f"{ctx.rank}.5"])[:, None]).repeat().batch(2)), False, DEPENDS),
    "map_by_rank": (lambda ctx: _one_shot(_rows().map(lambda v: v + float(ctx.rank)).batch(2)), False, DEPENDS),
    "python_after_rank_read": (lambda ctx: (ctx.rank, _one_shot(_generator().batch(2)))[1], False,
                               "model_fn read ctx.rank before making it, and it runs Python the toolkit cannot "
                               "see into"),
    "python_without_rank": (lambda ctx: _one_shot(_generator().batch(2)), True, INDEPENDENT),
    "opted_out": (lambda ctx: _one_shot(_rows().batch(2).with_options(_no_auto_shard())), False,
                  "its options set AutoShardPolicy.OFF"),
}


@pytest.mark.parametrize("form", PIPELINE_FORMS)
def test_a_pipeline_is_sharded_only_when_it_does_not_depend_on_the_rank(form):
    make, sharded, why = PIPELINE_FORMS[form]
    assert _decided(make) == [(sharded, why)]


def test_one_rank_and_noshard_input_read_every_pipeline_as_built():
    assert _decided(PIPELINE_FORMS["plain"][0], size=1) == [(False, "one data rank")]
    with tf.Graph().as_default():
        training = training_graph.build(lambda ctx: ptf.Model(
            loss=tf.reduce_mean(tf.matmul(_one_shot(_rows().batch(2)), tf.compat.v1.get_variable("w", [1, 1]))),
            optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1)), RunContext(rank=0, size=2), shard=False)
    assert [(d.sharded, d.why) for d in training.inputs.decisions()] == [(False, "--noshard_input")]


def test_the_plan_says_what_happened_to_each_pipeline():
    def model_fn(ctx):
        mine = _one_shot(_rows().shard(ctx.size, ctx.rank).batch(2))
        shared = _one_shot(_rows().batch(2))
        w = tf.compat.v1.get_variable("w", [1, 1])
        return ptf.Model(loss=tf.reduce_mean(tf.matmul(mine + shared, w)),
                         optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))
    plan = ptf.run(model_fn, plan_only=True, np=2, log_every=0).plan
    lines = [line for line in plan.table().splitlines() if line.startswith("input ")]
    assert lines == ["input OneShotIterator: read as built: it already holds a shard by the job's size (2)",
                     "input OneShotIterator_1: sharded by the toolkit (rank r of N reads batches r, r+N, ...): "
                     "it does not depend on the rank"]
    assert ptf.Plan.from_json(plan.to_json()).inputs == plan.inputs


def _single_device(batches):
    """Plain TF: the job's model trained on `batches` (features, targets), one a step."""
    from tests.jobs import input_shard_job as job
    graph = tf.Graph()
    with graph.as_default():
        feats = tf.compat.v1.placeholder(tf.float32, [None, job.DIM])
        labels = tf.compat.v1.placeholder(tf.float32, [None, 1])
        w = tf.compat.v1.get_variable("w", initializer=job.INITIAL_W)
        b = tf.compat.v1.get_variable("b", [1], initializer=tf.compat.v1.zeros_initializer())
        loss = tf.reduce_mean(tf.square(tf.matmul(feats, w) + b - labels))
        train = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for x, y in batches:
                sess.run(train, {feats: x, labels: y})
            return {"w": sess.run(w), "b": sess.run(b)}


def _batches(rows: np.ndarray, batch: int, steps: int):
    """The batches a repeated pipeline over `rows` hands its steps."""
    from tests.jobs import input_shard_job as job
    order = np.resize(rows, batch * steps)
    return [(job.FEATURES[order[k * batch:(k + 1) * batch]], job.TARGETS[order[k * batch:(k + 1) * batch]])
            for k in range(steps)]


def _joined(per_rank):
    """Each step's global batch: the ranks' batches of that step, joined."""
    return [tuple(np.concatenate(parts) for parts in zip(*step)) for step in zip(*per_rank)]


def _expected(form: str, size: int):
    """(the global batches single-device TF trains on, whether the toolkit shards the pipeline)."""
    from tests.jobs import input_shard_job as job
    every = np.arange(job.ROWS)
    if form == "sharded":          # rank r reads batches r, r+N, ...: the next N batches of the script
        return _batches(every, size * job.BATCH, job.STEPS), True
    if form == "whole":            # every rank reads the same batch
        return [(np.concatenate([x] * size), np.concatenate([y] * size))
                for x, y in _batches(every, job.BATCH, job.STEPS)], False
    if form == "shard_by_horovod":
        form = "shard_by_ctx"
    return _joined([_batches(job.rows_of_rank(form, r, size), job.BATCH, job.STEPS) for r in range(size)]), False


def test_two_ranks_train_exactly_on_what_each_pipeline_form_reads():
    """An unsharded pipeline is sharded by the toolkit; one the script splits by rank itself (a
    shard by ctx, data chosen by ctx.rank, a shard by Horovod's size) is read as built; with
    --noshard_input every rank reads the whole pipeline. Each trains as single-device TF on the
    global batches its ranks read."""
    from tests.jobs import input_shard_job as job
    out = tempfile.mkdtemp(prefix="ptf-input-shard-")
    proc = launch.run_ranks(2, ["tests/jobs/input_shard_job.py", out])
    assert proc.returncode == 0, launch.tail(proc)
    for form in job.PIPELINES:
        ranks = [np.load(os.path.join(out, f"{form}.rank{r}.npz")) for r in range(2)]
        batches, sharded = _expected(form, 2)
        assert bool(ranks[0]["sharded"]) == sharded, f"{form}: {ranks[0]['why']}"
        want = _single_device(batches)
        for name, value in want.items():
            error = reference.relative_error(ranks[0][f"var:{name}"], value)
            assert error <= 1e-5, f"{form}/{name}: relative error {error:.2e}"
        same = np.array_equal(ranks[0]["losses"], ranks[1]["losses"])
        assert same == (form == "whole"), f"{form}: rank losses {ranks[0]['losses']} and {ranks[1]['losses']}"
