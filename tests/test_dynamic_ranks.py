"""Dynamic tables on real ranks: every synchronous strategy that carries them trains the table
exactly as one process does (tests/dynamic_models.py's plain-TF reference), with admission,
eviction, capacity, string ids and ids from a huge range; checkpoints resume exactly, hold the
tables as arrays plain TF reads, and a killed rank holding the shards restarts exactly."""
import json
import os
import tempfile

import numpy as np
import pytest
import tensorflow as tf

from tests import dynamic_models, launch

STEPS = 8
TWO_RANKS = [   # name, strategy, optimizer, table options, further flags
    ("hybrid_adagrad", "hybrid", "adagrad", {}, []),
    ("ps_adam_admit_evict", "ps", "adam", {"admit_after": 2, "evict_after_steps": 3}, ["--partitions=3"]),
    ("auto_ftrl_capacity", "auto", "ftrl", {"admit_after": 2, "evict_after_steps": 3, "capacity": 6},
     ["--partitions=2"]),
    ("hybrid_momentum_strings", "hybrid", "momentum", {}, ["--strings=true"]),
    ("allreduce_sgd_evict", "allreduce", "sgd", {"evict_after_steps": 2}, []),
    ("collective_adagrad_admit", "collective", "adagrad", {"admit_after": 2}, ["--partitions=2"]),
]
THREE_RANKS = [
    ("hybrid_adagrad_admit_evict", "hybrid", "adagrad", {"admit_after": 2, "evict_after_steps": 3}, ["--partitions=2"]),
    ("ps_ftrl", "ps", "ftrl", {}, []),
    ("auto_adam_capacity", "auto", "adam", {"admit_after": 2, "evict_after_steps": 3, "capacity": 8},
     ["--partitions=3"]),
]


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


def _assert_as_one_process(out, name, size, optimizer, table, strings=False, steps=STEPS):
    losses, arrays, dense = dynamic_models.single_process(optimizer, size, steps, strings, **table)
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
    out = tempfile.mkdtemp(prefix="ptf-dynamic-")
    _job(size, _runs(cases, out), out)
    for name, strategy, optimizer, table, flags in cases:
        arrays = _assert_as_one_process(out, name, size, optimizer, table, "--strings=true" in flags)
        assert len(arrays["emb/ids"]) > 0
        if table.get("capacity"):
            assert len(arrays["emb/ids"]) <= table["capacity"] and arrays["emb/clock"][2] > 0   # some evicted
        plan = str(np.load(os.path.join(out, f"{name}.rank0.npz"))["plan"])
        assert "dynamic table emb: dim 3 float32" in plan


def test_a_checkpoint_holds_the_tables_as_arrays_and_resumes_exactly():
    out, ckpt = tempfile.mkdtemp(prefix="ptf-dynamic-"), tempfile.mkdtemp(prefix="ptf-dynamic-ckpt-")
    table = {"admit_after": 2, "evict_after_steps": 3}
    first = [("first", "hybrid", "adagrad", table, ["--partitions=2", f"--ckpt_dir={ckpt}"])]
    _job(2, _runs(first, out, steps=4), out)
    saved = tf.train.latest_checkpoint(ckpt)
    at_four = _assert_as_one_process(out, "first", 2, "adagrad", table, steps=4)
    np.testing.assert_array_equal(tf.train.load_variable(saved, "emb/ids"), at_four["emb/ids"])
    np.testing.assert_allclose(tf.train.load_variable(saved, "emb/values"), at_four["emb/values"], atol=1e-6)
    resumed = [("resumed", "hybrid", "adagrad", table, ["--partitions=3", f"--ckpt_dir={ckpt}"])]
    _job(2, _runs(resumed, out), out)            # three shards now: the arrays do not depend on the layout
    assert int(np.load(os.path.join(out, "resumed.rank0.npz"))["start_step"]) == 4
    got = np.load(os.path.join(out, "resumed.rank0.npz"))
    _, arrays, dense = dynamic_models.single_process("adagrad", 2, STEPS, **table)
    for key, want in arrays.items():
        np.testing.assert_allclose(got[f"var:{key}"], want, rtol=0, atol=1e-5, err_msg=key)
    np.testing.assert_allclose(got["var:dense"], dense, rtol=0, atol=1e-5)


def test_a_killed_rank_holding_the_shards_restarts_and_the_tables_end_exactly():
    out, ckpt = tempfile.mkdtemp(prefix="ptf-dynamic-"), tempfile.mkdtemp(prefix="ptf-dynamic-ckpt-")
    table = {"admit_after": 2, "evict_after_steps": 3}
    proc = _job(2, None, out, ["--name=restarted", "--strategy=hybrid", "--optimizer=adagrad",
                               f"--table={json.dumps(table)}", f"--steps={STEPS}", f"--ckpt_dir={ckpt}",
                               "--ckpt_every=2", "--max_restarts=1", "--die_at_step=5", "--die_rank=0"])
    assert "rank 0 on localhost exited with status 137" in proc.stdout + proc.stderr, launch.tail(proc)
    assert int(np.load(os.path.join(out, "restarted.rank0.npz"))["start_step"]) == 4
    _assert_as_one_process(out, "restarted", 2, "adagrad", table)
