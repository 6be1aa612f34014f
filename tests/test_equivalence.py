"""N real ranks of every strategy end with the same variables as single-device TF trained on the
concatenation of the ranks' batches (max |delta| / max |w| <= 1e-5; 1e-4 for Adam)."""
import functools
import json
import os
import tempfile

import numpy as np
import pytest

from tests import cases, launch, reference

STRATEGIES = ("hybrid", "ps", "allreduce", "collective")
# every strategy on 3 ranks (uneven shards and batches); hybrid on 2 as well, under mpirun
JOBS = [(strategy, 3) for strategy in STRATEGIES] + [("hybrid", 2)]
LAUNCHERS = {("hybrid", 2): "mpirun"}


@functools.lru_cache(maxsize=None)
def job_output(strategy: str, size: int) -> str:
    """Runs every case once for (strategy, size) in one multi-rank job; returns its output dir."""
    launcher = LAUNCHERS.get((strategy, size), "horovodrun")
    out = tempfile.mkdtemp(prefix=f"ptf-{strategy}-{size}-")
    proc = launch.run_ranks(size, ["tests/jobs/equivalence_job.py", out, strategy] + [c[0] for c in cases.CASES],
                            launcher=launcher)
    assert proc.returncode == 0, f"{launcher} job failed:\n{launch.tail(proc)}"
    return out


@functools.lru_cache(maxsize=None)
def expected(model: str, optimizer: str, size: int):
    if model in cases.PER_RANK_BATCH_STATISTICS:
        return reference.train_per_rank_statistics(model, optimizer, size)
    return reference.train_single_device(model, optimizer, size)


def _check_case(out_dir, name, size):
    _, model, optimizer, _ = cases.CASE_BY_NAME[name]
    want = expected(model, optimizer, size)
    ranks = [np.load(os.path.join(out_dir, f"{name}.rank{r}.npz")) for r in range(size)]
    tolerance = 1e-4 if optimizer.endswith("adam") else 1e-5
    for var_name, value in want.items():
        got = ranks[0][f"var:{var_name}"]
        assert got.shape == value.shape, f"{name}/{var_name}: shape {got.shape} != {value.shape}"
        error = reference.relative_error(got, value)
        assert error <= tolerance, f"{name}/{var_name}: relative error {error:.2e} > {tolerance}"
        for other in ranks[1:]:    # every rank hands back the same whole variables
            np.testing.assert_array_equal(other[f"var:{var_name}"], got)
    assert sorted(k[4:] for k in ranks[0].files if k.startswith("var:")) == sorted(want)
    assert all(int(r["global_step"]) == cases.STEPS for r in ranks), "global step is not one number"
    # training really moved the variables away from where they started
    initial = reference.train_single_device(model, optimizer, size, steps=0)
    moved = [reference.relative_error(want[k], initial[k]) > 1e-4 for k in want if "moving" in k]
    if model in cases.FROZEN_STATE:
        assert moved and not any(moved), "frozen model state changed"
    else:
        assert all(moved), "model state did not change"
    assert any(reference.relative_error(want[k], initial[k]) > 1e-3 for k in want)
    return ranks


@pytest.mark.parametrize("strategy,size", JOBS)
@pytest.mark.parametrize("name", [c[0] for c in cases.CASES])
def test_matches_single_device(strategy, size, name):
    _check_case(job_output(strategy, size), name, size)


@pytest.mark.parametrize("strategy,size", [("hybrid", 2), ("ps", 3)])
def test_auto_sharding_follows_lookup_layout(strategy, size):
    out = job_output(strategy, size)
    assert "'emb': 'mod'" in str(np.load(os.path.join(out, "auto_mod.rank0.npz"))["layouts"])
    assert "'emb': 'div'" in str(np.load(os.path.join(out, "auto_div.rank0.npz"))["layouts"])


@pytest.mark.parametrize("name", [c[0] for c in cases.CASES])
def test_auto_strategy_matches_single_device(name):
    _check_case(job_output("auto", 2), name, 2)


@pytest.mark.parametrize("strategy,size", [("hybrid", 2), ("ps", 3), ("allreduce", 3)])
@pytest.mark.parametrize("name,moving_mean", [("bn", "bn/moving_mean"), ("keras_bn", "sequential/bn_in/moving_mean")])
def test_moving_mean_of_the_input_equals_single_device(strategy, size, name, moving_mean):
    """A batch norm on the input averages each rank's batch means; the mean over ranks of the
    ranks' moving means is then exactly single-device training's on the concatenated batch."""
    _, model, optimizer, _ = cases.CASE_BY_NAME[name]
    got = np.load(os.path.join(job_output(strategy, size), f"{name}.rank0.npz"))[f"var:{moving_mean}"]
    want = reference.train_single_device(model, optimizer, size)[moving_mean]
    assert reference.relative_error(got, want) <= 1e-5
    assert reference.relative_error(want, np.zeros_like(want)) > 0.1     # it moved


# A machine where every received byte and TF's gRPC master cost much CPU: on two hosts auto's cost
# model puts the table on the alltoall route, which receives only the rows its rank serves.
ALLTOALL_MACHINE = {"runtime_cpu_s": 0.001, "task_cpu_s": 0.001, "message_overhead_s": 1e-4, "rpc_overhead_s": 1e-4,
                    "master_cpu_s": 1.0, "received_cpu_s_per_byte": 1e-3}


def test_auto_on_the_alltoall_route_matches_single_device():
    """Two emulated hosts (tools.cluster), strategy auto: the plan puts the table on the alltoall
    route and training equals single-device TF on both ranks' batches."""
    out, calibration = tempfile.mkdtemp(), os.path.join(tempfile.mkdtemp(), "calibration.json")
    with open(calibration, "w") as f:
        json.dump(ALLTOALL_MACHINE, f)
    proc = launch.on_emulated_hosts([launch.PYTHON, "tests/jobs/train_case.py", "--case=mixed_adam", f"--out={out}",
                                     "--log_every=0", "--strategy=auto", f"--calibration={calibration}",
                                     f"--steps={cases.STEPS}"])
    assert proc.returncode == 0, launch.tail(proc)
    ranks = [np.load(os.path.join(out, f"mixed_adam.rank{r}.npz")) for r in range(2)]
    assert json.loads(str(ranks[0]["routes"])) == {"emb": "alltoall", "w": "allreduce", "b": "allreduce"}
    want = reference.train_single_device("mixed", "adam", 2)
    for name, value in want.items():
        assert reference.relative_error(ranks[0][f"var:{name}"], value) <= 1e-4, name
        np.testing.assert_array_equal(ranks[1][f"var:{name}"], ranks[0][f"var:{name}"])
