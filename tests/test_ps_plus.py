"""PS+ (--strategy ps_plus) on real ranks. One rank with --max_staleness=0 (every step waits for
its own push to come back) is single-device training; three ranks train asynchronously: every
push is applied exactly once (the global step counts them), the servers' staleness histogram
is reported, bounded staleness holds, every rank returns the same values, and the MLP learns.
A rank killed mid-run: without server state the others finish; with it the job stops, naming it."""
import ast
import collections
import functools
import json
import os
import re
import tempfile

import numpy as np
import pytest

from rewriters.ps_plus.runner import STALENESS_BUCKETS
from tests import launch
from tests.test_equivalence import _check_case

ONE_RANK_CASES = ("mixed_sgd", "mixed_momentum", "mixed_adagrad", "mixed_adam", "dense_only", "sparse_only", "clip_decay_adam",
                  "keras_bn", "minimize_gs", "vocab_column", "hash_table", "init_iter", "sparse_feed")
ASYNC_STEPS = 120     # enough that a rank starting a second late still gets steps


def one_rank_output() -> str:
    return _one_rank_runs()["lazy"]


@functools.lru_cache(maxsize=None)
def _one_rank_runs() -> dict:
    """The one-rank runs, sparse variables pulled by their rows (lazy) and whole (eager), in one
    job (tests/jobs/several_runs.py)."""
    outs = {pull: tempfile.mkdtemp(prefix=f"ptf-psplus-1-{pull}-") for pull in ("lazy", "eager")}
    given = [{"out": outs["lazy"], "strategy": "ps_plus", "names": list(ONE_RANK_CASES), "flags": ["--max_staleness=0"]},
             {"out": outs["eager"], "strategy": "ps_plus", "names": list(EAGER_SPARSE_CASES),
              "flags": ["--max_staleness=0", "--ps_plus_sparse_pull=eager"]}]
    proc = launch.run_ranks(1, ["tests/jobs/equivalence_job.py", f"--runs={json.dumps(given)}"], launcher="python")
    assert proc.returncode == 0, f"ps_plus job failed:\n{launch.tail(proc)}"
    return outs


@pytest.mark.parametrize("name", ONE_RANK_CASES)
def test_one_rank_is_single_device_training(name):
    _check_case(one_rank_output(), name, 1)


EAGER_SPARSE_CASES = ("sparse_only", "mixed_adagrad", "mixed_adam")


def eager_sparse_output() -> str:
    return _one_rank_runs()["eager"]


@pytest.mark.parametrize("name", EAGER_SPARSE_CASES)
def test_one_rank_with_sparse_variables_pulled_whole_is_single_device_training(name):
    _check_case(eager_sparse_output(), name, 1)


@functools.lru_cache(maxsize=None)
def three_ranks_run(max_staleness: int):
    out = tempfile.mkdtemp(prefix="ptf-psplus-3-")
    proc = launch.run_ranks(3, ["tests/jobs/train_case.py", "--case=mixed_momentum", f"--out={out}",
                                "--strategy=ps_plus", f"--steps={ASYNC_STEPS}", f"--log_every={ASYNC_STEPS}",
                                f"--max_staleness={max_staleness}", f"--logdir={out}/tb"])
    assert proc.returncode == 0, f"ps_plus job failed:\n{launch.tail(proc)}"
    ranks = [np.load(os.path.join(out, f"mixed_momentum.rank{r}.npz"), allow_pickle=True) for r in range(3)]
    return proc, out, ranks


def three_ranks(max_staleness: int):
    _, _, ranks = three_ranks_run(max_staleness)
    return ranks, [ast.literal_eval(str(r["extras"])) for r in ranks]


@pytest.mark.parametrize("max_staleness", (16, 1))
def test_three_ranks_apply_every_push_exactly_once(max_staleness):
    ranks, extras = three_ranks(max_staleness)
    pushes = [sum(e["staleness"].values()) for e in extras]
    global_step = int(ranks[0]["global_step"])
    assert sum(pushes) == global_step, (pushes, global_step)      # no push lost, none applied twice
    assert global_step == ASYNC_STEPS                              # the ranks share one budget of steps
    assert [len(r["losses"]) for r in ranks] == pushes             # one push per step
    assert all(p > 0 for p in pushes)
    for r in ranks[1:]:                                            # all return the final global values
        for key in (k for k in ranks[0].files if k.startswith("var:")):
            np.testing.assert_array_equal(r[key], ranks[0][key])


@pytest.mark.parametrize("max_staleness", (16, 1))
def test_bounded_staleness_and_histogram(max_staleness):
    ranks, extras = three_ranks(max_staleness)
    for e in extras:
        assert all(isinstance(tau, int) and tau >= 0 for tau in e["staleness"])
        assert max(e["copy_lag"]) <= max_staleness                 # no step ran on an older copy
        assert sum(e["copy_lag"].values()) == sum(e["staleness"].values())


def test_staleness_histogram_per_rank_in_result_summary_and_tensorboard():
    proc, out, ranks = three_ranks_run(16)
    by_rank = [ast.literal_eval(str(r["histograms"]))["staleness"] for r in ranks]
    assert by_rank[0] == by_rank[1] == by_rank[2]                  # the servers' count, read by every rank
    extras = [ast.literal_eval(str(r["extras"])) for r in ranks]
    top = STALENESS_BUCKETS - 1                                    # the servers' last bucket: tau >= top
    for rank, e in enumerate(extras):                              # what the servers counted is what each
        told = collections.Counter({min(tau, top): 0 for tau in e["staleness"]})   # rank's pusher was told
        for tau, n in e["staleness"].items():
            told[min(tau, top)] += n
        assert by_rank[0][rank] == dict(told)
    assert sum(sum(c.values()) for c in by_rank[0].values()) == int(ranks[0]["global_step"])
    for rank in range(3):                                          # one summary line per rank
        assert re.search(rf"^(\[0\]<stdout>:)?staleness rank {rank}: .*\(mean [\d.]+, max \d+, n \d+\)$",
                         proc.stdout, re.M), proc.stdout[-2000:]
    import tensorflow as tf
    events = [os.path.join(out, "tb", f) for f in os.listdir(os.path.join(out, "tb"))]
    tags = {v.tag for path in events for e in tf.compat.v1.train.summary_iterator(path) for v in e.summary.value
            if v.HasField("histo")}
    assert {"staleness/rank0", "staleness/rank1", "staleness/rank2"} <= tags, tags


def test_three_async_ranks_learn():
    """The MLP regresses a fixed teacher: asynchronous training must bring its loss far down
    (the test cases above have random labels, whose loss barely moves)."""
    proc = launch.run_ranks(1, ["-m", "models.mlp", "--np=3", "--strategy=ps_plus", "--steps=600", "--log_every=0"],
                            launcher="python", timeout=240)
    assert proc.returncode == 0, launch.tail(proc)
    first, last = (float(x) for x in re.search(r"mlp: first loss ([\d.]+) last loss ([\d.]+)", proc.stdout).groups())
    assert last < 0.1 * first, (first, last)


KILL_STEPS, KILL_AT = 300, 3


def _kill_run(victim: int, extra=()):
    out = tempfile.mkdtemp(prefix="ptf-psplus-kill-")
    proc = launch.run_ranks(1, ["tests/jobs/train_case.py", "--np=3", "--case=mixed_momentum", f"--out={out}",
                                "--strategy=ps_plus", f"--steps={KILL_STEPS}", "--log_every=0",
                                f"--die_at_step={KILL_AT}", f"--die_rank={victim}", *extra], launcher="python",
                            timeout=240)
    return proc, out


def test_a_killed_rank_without_server_state_leaves_the_others_to_finish():
    proc, out = _kill_run(victim=2)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, launch.tail(proc)
    assert "rank 2 on localhost exited with status 137; the other ranks go on without it" in output
    for rank in (0, 1):
        assert f"parallax_tf rank {rank}: rank 2 (" in output                # each survivor noticed, by name
    ranks = [np.load(os.path.join(out, f"mixed_momentum.rank{r}.npz"), allow_pickle=True) for r in (0, 1)]
    assert not os.path.exists(os.path.join(out, "mixed_momentum.rank2.npz"))
    assert [list(r["lost_ranks"]) for r in ranks] == [[2], [2]]
    pushes = [len(r["losses"]) for r in ranks]
    global_step = int(ranks[0]["global_step"])
    assert [int(r["start_step"]) for r in ranks] == [0, 0]    # so rank 2's step 3 is its 4th ticket
    # rank 2 claimed KILL_AT + 1 tickets and pushed at most KILL_AT of them (its last outbox
    # entries may die with it); the survivors used every other ticket
    assert sum(pushes) == KILL_STEPS - KILL_AT - 1, pushes
    assert sum(pushes) + KILL_AT - 2 <= global_step <= sum(pushes) + KILL_AT, (pushes, global_step)
    for key in (k for k in ranks[0].files if k.startswith("var:")):
        np.testing.assert_array_equal(ranks[1][key], ranks[0][key])


def test_a_killed_server_rank_stops_the_job_and_is_named():
    proc, out = _kill_run(victim=0)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "rank 0 on localhost exited with status 137; stopping the other ranks" in output
    assert re.search(r"parallax_tf rank [12]: .*lost: rank 0 \(", output), launch.tail(proc)
    assert not [f for f in os.listdir(out) if f.endswith(".npz")]


def test_a_killed_server_rank_restarts_the_job_from_its_checkpoint():
    """With --max_restarts the server rank's death restarts every rank: the job resumes at the
    checkpoint's global step, ends at the requested one, and the ranks agree on the values."""
    ckpt = tempfile.mkdtemp(prefix="ptf-psplus-ckpt-")
    proc, out = _kill_run(victim=0, extra=[f"--ckpt_dir={ckpt}", "--ckpt_every=10", "--max_restarts=1",
                                                 "--die_once", "--die_at_step=40"])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, launch.tail(proc)
    resumed = re.search(r"1 restart\(s\): rank 0 exited with status 137, resumed at step (\d+)", output)
    assert resumed, launch.tail(proc)
    ranks = [np.load(os.path.join(out, f"mixed_momentum.rank{r}.npz"), allow_pickle=True) for r in range(3)]
    assert [int(r["start_step"]) for r in ranks] == [int(resumed.group(1))] * 3
    assert 0 < int(resumed.group(1)) < KILL_STEPS
    assert [int(r["global_step"]) for r in ranks] == [KILL_STEPS] * 3
    for key in (k for k in ranks[0].files if k.startswith("var:")):
        for other in ranks[1:]:
            np.testing.assert_array_equal(other[key], ranks[0][key])


def test_two_hosts_every_push_reaches_every_server_task():
    """Variables spread over two hosts' servers: each push is applied on every task (a task's
    version counts the pushes it applied; a push that reached only PS 0 once went unnoticed)."""
    from tools import netns
    out = tempfile.mkdtemp(prefix="ptf-psplus-2h-")
    proc = launch.on_emulated_hosts([launch.PYTHON, "tests/jobs/train_case.py", "--case=mixed_momentum",
                                     f"--out={out}", "--strategy=ps_plus", f"--steps={ASYNC_STEPS}", "--log_every=0"],
                                    timeout=300)
    assert proc.returncode == 0, launch.tail(proc)
    ranks = [np.load(os.path.join(out, f"mixed_momentum.rank{r}.npz"), allow_pickle=True) for r in range(2)]
    extras = ast.literal_eval(str(ranks[0]["extras"]))
    assert len(extras["task_versions"]) == (2 if netns.have_root() else 1), extras["task_versions"]
    assert set(extras["task_versions"].values()) == {ASYNC_STEPS} == {int(ranks[0]["global_step"])}
    for key in (k for k in ranks[0].files if k.startswith("var:")):
        np.testing.assert_array_equal(ranks[1][key], ranks[0][key])
