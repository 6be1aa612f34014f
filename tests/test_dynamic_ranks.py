"""Dynamic tables on real ranks: every synchronous strategy that carries them trains the table
exactly as one process does (tests/dynamic_models.py's plain-TF reference), with admission,
eviction, capacity, string ids and ids from a huge range; checkpoints resume exactly, hold the
tables as arrays plain TF reads, and a killed rank holding the shards restarts exactly."""
import functools
import json
import os
import shutil
import tempfile

import numpy as np
import pytest
import tensorflow as tf

from parallax_tf import dynamic
from parallax_tf.dynamic.state import DynamicState
from tests import dynamic_models, launch, serving

STEPS = 8
CKPT_ROOT = tempfile.mkdtemp(prefix="ptf-dynamic-ckpts-")
ADMIT_EVICT = {"admit_after": 2, "evict_after_steps": 3}
TWO_RANKS = [   # name, strategy, optimizer, table options, further flags
    ("hybrid_adagrad", "hybrid", "adagrad", {}, [f"--ckpt_dir={CKPT_ROOT}/first_use"]),
    ("ps_adam_admit_evict", "ps", "adam", {"admit_after": 2, "evict_after_steps": 3}, ["--partitions=3"]),
    ("auto_ftrl_capacity", "auto", "ftrl", {"admit_after": 2, "evict_after_steps": 3, "capacity": 6},
     ["--partitions=2"]),
    ("hybrid_momentum_strings", "hybrid", "momentum", {}, ["--strings=true"]),
    ("allreduce_sgd_evict", "allreduce", "sgd", {"evict_after_steps": 2}, []),
    ("collective_adagrad_admit", "collective", "adagrad", {"admit_after": 2}, ["--partitions=2"]),
    # two lookups of the table: their ids merged before the push; the same model as one lookup
    ("hybrid_adagrad_two_lookups", "hybrid", "adagrad", {"admit_after": 2}, ["--partitions=2", "--twice=true"]),
    # a law the compiled ops leave to standard ops: the servers take the accumulators' path
    ("hybrid_adagrad_normal_law", "hybrid", "adagrad", {"normal": 0.3, "capacity": 6}, ["--partitions=2"]),
    # every rank holds the table; the pushes are allgathered and every rank applies them
    ("hybrid_adagrad_replicated_strings", "hybrid", "adagrad", ADMIT_EVICT, ["--dynamic_tables=replicated",
                                                                              "--strings=true"]),
    ("auto_adam_replicated_two_lookups", "auto", "adam", {"admit_after": 2, "capacity": 6},
     ["--dynamic_tables=replicated", "--twice=true"]),
    ("allreduce_sgd_replicated_evict", "allreduce", "sgd", {"evict_after_steps": 2}, ["--dynamic_tables=replicated"]),
]
THREE_RANKS = [
    ("hybrid_adagrad_admit_evict", "hybrid", "adagrad", {"admit_after": 2, "evict_after_steps": 3}, ["--partitions=2"]),
    ("ps_ftrl", "ps", "ftrl", {}, []),
    ("auto_adam_capacity", "auto", "adam", {"admit_after": 2, "evict_after_steps": 3, "capacity": 8},
     ["--partitions=3"]),
    # a compiled table and one the standard ops end on the same servers: routed reads and tokens
    ("hybrid_momentum_mixed", "hybrid", "momentum", {"admit_after": 2}, ["--partitions=2", "--mixed=true"]),
    ("auto_ftrl_replicated_capacity", "auto", "ftrl", {"admit_after": 2, "evict_after_steps": 3, "capacity": 8},
     ["--dynamic_tables=replicated"]),
]


# four steps with a checkpoint at the end: resumed and exported by the tests below
FIRST = ("first", "hybrid", "adagrad", ADMIT_EVICT, ["--partitions=2", f"--ckpt_dir={CKPT_ROOT}/admit_evict"])


@functools.lru_cache(maxsize=None)
def _two_rank_job() -> str:
    """One job of 2 ranks for every 2-rank run of this file; its output directory."""
    out = tempfile.mkdtemp(prefix="ptf-dynamic-")
    _job(2, _runs(TWO_RANKS, out) + _runs([FIRST], out, steps=4), out)
    return out


def _runs(cases, out, steps=STEPS, extra=()):
    return [{"flags": [f"--name={name}", f"--strategy={strategy}", f"--optimizer={optimizer}",
                       f"--table={json.dumps(table)}", f"--steps={steps}", *flags, *extra]}
            for name, strategy, optimizer, table, flags in cases]


def _job(size, runs, out, extra=(), timeout=400):
    argv = ["tests/jobs/dynamic_job.py", f"--np={size}", f"--out={out}", "--log_every=0", *extra]
    if runs is not None:
        argv.append("--runs=" + json.dumps(runs))
    proc = launch.run_ranks(1, argv, launcher="python", timeout=timeout)
    assert proc.returncode == 0, launch.tail(proc)
    return proc


def _assert_as_one_process(out, name, size, optimizer, table, strings=False, steps=STEPS, mixed=False):
    losses, arrays, dense = dynamic_models.single_process(optimizer, size, steps, strings, mixed, **table)
    tol = 1e-4 if optimizer == "adam" else 1e-5
    for rank in range(size):
        got = np.load(os.path.join(out, f"{name}.rank{rank}.npz"))
        start = int(got["start_step"])          # a resumed run's losses begin there
        np.testing.assert_allclose(got["mean_losses"], losses[start:], rtol=0, atol=tol, err_msg=f"{name} {rank}")
        np.testing.assert_allclose(got["var:dense"], dense, rtol=0, atol=tol)
        for key, want in arrays.items():
            if want.dtype.kind == "f":
                np.testing.assert_allclose(got[f"var:{key}"], want, rtol=0, atol=tol, err_msg=f"{name} {key}")
            else:
                np.testing.assert_array_equal(got[f"var:{key}"], want, err_msg=f"{name} {key}")
    return arrays


@pytest.mark.parametrize("size,cases", [(2, TWO_RANKS), (3, THREE_RANKS)], ids=["2_ranks", "3_ranks"])
def test_dynamic_tables_train_on_ranks_as_in_one_process(size, cases):
    if size == 2:
        out = _two_rank_job()
    else:
        out = tempfile.mkdtemp(prefix="ptf-dynamic-")
        _job(size, _runs(cases, out), out)
    for name, strategy, optimizer, table, flags in cases:
        arrays = _assert_as_one_process(out, name, size, optimizer, table, "--strings=true" in flags,
                                        mixed="--mixed=true" in flags)
        if "--mixed=true" in flags:
            assert len(arrays["side/ids"]) > 0
        assert len(arrays["emb/ids"]) > 0
        if table.get("capacity"):
            assert len(arrays["emb/ids"]) <= table["capacity"] and arrays["emb/clock"][2] > 0   # some evicted
        saved = np.load(os.path.join(out, f"{name}.rank0.npz"))
        plan = str(saved["plan"])
        assert "dynamic table emb: dim 3 float32, " in plan
        if "--dynamic_tables=replicated" in flags:
            assert "replicated on every rank (pushes allgathered) (--dynamic_tables)" in plan
        elif strategy == "auto" and not any(f.startswith("--partitions") for f in flags):  # the cost model's
            assert "(cost model: predicted step" in plan
        else:
            assert "shards by id" in plan
        assert "'dynamic_tables': {'emb': {" in str(saved["extras"])
        for table_name in ("emb", "side") if "--mixed=true" in flags else ("emb",):
            clock = arrays[f"{table_name}/clock"]
            assert f"'{table_name}': {{'rows': {len(arrays[f'{table_name}/ids'])}, 'admitted': {clock[1]}, " \
                   f"'evicted': {clock[2]}}}" in str(saved["extras"])


def test_a_checkpoint_holds_the_tables_as_arrays_and_resumes_exactly():
    out, table = _two_rank_job(), ADMIT_EVICT
    ckpt = os.path.join(CKPT_ROOT, "admit_evict")
    saved = tf.train.latest_checkpoint(ckpt)
    at_four = _assert_as_one_process(out, "first", 2, "adagrad", table, steps=4)
    np.testing.assert_array_equal(tf.train.load_variable(saved, "emb/ids"), at_four["emb/ids"])
    np.testing.assert_allclose(tf.train.load_variable(saved, "emb/values"), at_four["emb/values"], atol=1e-6)
    resumed = []
    for name, layout in (("resumed", "--partitions=3"), ("resumed_replicated", "--dynamic_tables=replicated")):
        resume_from = tempfile.mkdtemp(prefix="ptf-dynamic-ckpt-")    # a copy: the export test reads the first
        os.rmdir(resume_from)
        shutil.copytree(ckpt, resume_from)
        resumed.append((name, "hybrid", "adagrad", table, [layout, f"--ckpt_dir={resume_from}"]))
    _job(2, _runs(resumed, out), out)     # three shards, or a copy on each rank: the arrays do not depend on it
    _, arrays, dense = dynamic_models.single_process("adagrad", 2, STEPS, **table)
    for name, *_ in resumed:
        for rank in range(2):               # every rank's copy of a replicated table was loaded
            got = np.load(os.path.join(out, f"{name}.rank{rank}.npz"))
            assert int(got["start_step"]) == 4
            for key, want in arrays.items():
                np.testing.assert_allclose(got[f"var:{key}"], want, rtol=0, atol=1e-5, err_msg=f"{name} {key}")
            np.testing.assert_allclose(got["var:dense"], dense, rtol=0, atol=1e-5)


def _served(export_dir: str, feed: dict) -> np.ndarray:
    """The exported model's predictions from a plain-TF subprocess that never imports parallax_tf
    (tf.saved_model.load and a tf.compat.v1 loader, as TF Serving loads it)."""
    served = serving.serve(export_dir, feed)
    assert served["imported"].size == 0 and not [op for op in served["ops"] if op.startswith("Parallax")]
    assert "MutableHashTableOfTensorsV2" not in served["ops"]
    np.testing.assert_array_equal(served["tf2:predictions"], served["v1:predictions"])
    return served["v1:predictions"]


def _one_process_predictions(model_fn, checkpoint: str, feed: dict):
    """model_fn in one process with its table holding the checkpoint's arrays and `dense`
    restored: (predictions, dense, the initial rows of feed's ids)."""
    values = {k: tf.train.load_variable(checkpoint, k) for k, _ in tf.train.list_variables(checkpoint)}
    graph = tf.Graph()
    with graph.as_default():
        model = model_fn()
        (table,) = dynamic.tables(graph)
        state = DynamicState([table])
        initial = table.shards[0].initial_rows(tf.constant(feed["ids"].ravel()))
        dense = [v for v in tf.compat.v1.global_variables() if v.op.name == "dense"][0]
        with tf.compat.v1.Session(graph=graph) as sess:
            state.load(sess, values)
            dense.load(values["dense"], sess)
            feeds = {graph.get_tensor_by_name(k + ":0"): v for k, v in feed.items()}
            return sess.run(model.predictions, feeds), values["dense"], sess.run(initial)


@pytest.mark.parametrize("name,table", [("first_use", {}), ("admit_evict", ADMIT_EVICT)])
def test_an_exported_table_serves_its_live_rows_and_what_training_reads_for_other_ids(name, table):
    """Ids with a row, ids never seen and (with admission) ids seen but not admitted: the served
    model answers as the trained model in one process; an id without a row reads its initial row
    where ids are admitted on first use, zeros otherwise."""
    _two_rank_job()
    ckpt = os.path.join(CKPT_ROOT, name)
    checkpoint = tf.train.latest_checkpoint(ckpt)
    live = tf.train.load_variable(checkpoint, "emb/ids")
    waiting = sorted(set(tf.train.load_variable(checkpoint, "emb/seen_ids")) - set(live))
    unseen = [3, 2 ** 61 + 5, 17]
    assert not set(unseen) & set(tf.train.load_variable(checkpoint, "emb/seen_ids"))
    ids = np.array([[live[0], live[-1], unseen[0]], [unseen[1], live[1], (waiting or unseen)[0]], unseen], np.int64)
    export_dir = os.path.join(tempfile.mkdtemp(prefix="ptf-dynamic-export-"), "1")
    proc = launch.run_ranks(1, ["-m", "parallax_tf", "export", f"--model=tests.dynamic_models:exported_{name}",
                                f"--ckpt_dir={ckpt}", f"--export_dir={export_dir}"], launcher="python", timeout=300)
    assert proc.returncode == 0, launch.tail(proc)
    served = _served(export_dir, {"ids": ids})
    want, dense, initial = _one_process_predictions(dynamic_models.model_fn("adagrad", **table), checkpoint,
                                                    {"ids": ids})
    np.testing.assert_allclose(served, want, rtol=0, atol=1e-6)
    only_unseen = initial[-3:].sum(0) @ dense[:, 0] if not table else 0.0
    np.testing.assert_allclose(served[-1], only_unseen, rtol=0, atol=1e-6)
    assert (not table) == (abs(served[-1]) > 1e-4)


@pytest.mark.parametrize("where", ["servers", "replicated"])
def test_a_killed_rank_holding_the_shards_restarts_and_the_tables_end_exactly(where):
    """Rank 0 dies: on the servers it held the shards of host 0; replicated, its copy."""
    out, ckpt = tempfile.mkdtemp(prefix="ptf-dynamic-"), tempfile.mkdtemp(prefix="ptf-dynamic-ckpt-")
    table = {"admit_after": 2, "evict_after_steps": 3}
    proc = _job(2, None, out, ["--name=restarted", "--strategy=hybrid", "--optimizer=adagrad",
                               f"--table={json.dumps(table)}", f"--steps={STEPS}", f"--ckpt_dir={ckpt}",
                               "--ckpt_every=2", "--max_restarts=1", "--die_at_step=5", "--die_rank=0",
                               f"--dynamic_tables={where}"])
    assert "rank 0 on localhost exited with status 137" in proc.stdout + proc.stderr, launch.tail(proc)
    assert int(np.load(os.path.join(out, "restarted.rank0.npz"))["start_step"]) == 4
    _assert_as_one_process(out, "restarted", 2, "adagrad", table)
