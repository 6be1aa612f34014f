"""A rank killed mid-training under --np with --max_restarts: the launcher stops every rank and
starts the job again from the latest checkpoint, which then ends exactly where an uninterrupted
run ends; past --max_restarts the job stops as it always did."""
import os
import tempfile

import numpy as np
import pytest

from tests import cases, launch, reference

STEPS, DIE_AT, EVERY = 10, 5, 2


def _run(case: str, strategy: str, victim: int, extra=(), size: int = 3, trigger=None, ckpt_every: int = EVERY,
         die_at=DIE_AT):
    ckpt, out = tempfile.mkdtemp(prefix="ptf-restart-"), tempfile.mkdtemp(prefix="ptf-restart-")
    argv = ["tests/jobs/train_case.py", f"--np={size}", f"--case={case}", f"--strategy={strategy}", f"--out={out}",
            "--log_every=0", f"--steps={STEPS}", f"--ckpt_dir={ckpt}", f"--ckpt_every={ckpt_every}",
            f"--die_at_step={die_at}", f"--die_rank={victim}", *extra]
    if trigger is not None:
        argv.append(f"--die_trigger_rank={trigger}")
    return launch.run_ranks(1, argv, launcher="python", timeout=300), out


@pytest.mark.parametrize("strategy,case,victim,trigger,data_ranks", [
    ("hybrid", "mixed_adagrad", 0, None, 3),          # the rank whose process holds the PS state
    ("allreduce", "mixed_adam", 2, None, 3),          # a worker only
    ("stanza", "cnn_momentum", 2, 0, 2),              # the FC node (it reads no data: rank 0's step kills it)
], ids=["hybrid_ps_host", "allreduce_worker", "stanza_fc_node"])
def test_a_killed_rank_restarts_from_the_checkpoint_and_ends_exactly(strategy, case, victim, trigger, data_ranks):
    proc, out = _run(case, strategy, victim, ["--max_restarts=1", "--die_once"], trigger=trigger)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, launch.tail(proc)
    assert f"rank {victim} on localhost exited with status 137; stopping the other ranks" in output
    resumed = DIE_AT - DIE_AT % EVERY       # the last checkpoint before the death
    assert f"restart 1 of 1: every rank starts again and resumes from the latest checkpoint (step {resumed})" \
        in output, launch.tail(proc)
    assert f"1 restart(s): rank {victim} exited with status 137, resumed at step {resumed}" in output
    _, model, optimizer, _ = cases.CASE_BY_NAME[case]
    want = reference.train_single_device(model, optimizer, data_ranks, steps=STEPS)
    tolerance = 1e-4 if optimizer.endswith("adam") else 1e-5
    for rank in range(3):
        got = np.load(os.path.join(out, f"{case}.rank{rank}.npz"))
        assert int(got["global_step"]) == STEPS and int(got["start_step"]) == resumed
        for name, value in want.items():
            assert reference.relative_error(got[f"var:{name}"], value) <= tolerance, (rank, name)


def test_a_rank_killed_while_writing_a_checkpoint_resumes_from_the_one_before():
    """Rank 0 dies with step 6's checkpoint written but not yet in place: the restart takes step
    4's, and the job still ends exactly."""
    proc, out = _run("mixed_adagrad", "hybrid", 0, ["--max_restarts=1", "--die_writing_checkpoint=6"], die_at=-1)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, launch.tail(proc)
    assert "1 restart(s): rank 0 exited with status 137, resumed at step 4" in output, launch.tail(proc)
    got = np.load(os.path.join(out, "mixed_adagrad.rank0.npz"))
    assert int(got["global_step"]) == STEPS and int(got["start_step"]) == 4
    want = reference.train_single_device("mixed", "adagrad", 3, steps=STEPS)
    for name, value in want.items():
        assert reference.relative_error(got[f"var:{name}"], value) <= 1e-5, name


def test_an_in_memory_commit_resumes_where_no_disk_checkpoint_is():
    """--commit_every 1 and no disk checkpoint before the death: the restart resumes from the
    commit rank 0 made right before it died (in its host's memory, kept by the launcher)."""
    proc, out = _run("mixed_adagrad", "hybrid", 0, ["--max_restarts=1", "--die_once", "--commit_every=1"],
                     ckpt_every=100)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, launch.tail(proc)
    assert f"1 restart(s): rank 0 exited with status 137, resumed at step {DIE_AT}" in output, launch.tail(proc)
    got = np.load(os.path.join(out, "mixed_adagrad.rank0.npz"))
    assert int(got["global_step"]) == STEPS and int(got["start_step"]) == DIE_AT
    want = reference.train_single_device("mixed", "adagrad", 3, steps=STEPS)
    for name, value in want.items():
        assert reference.relative_error(got[f"var:{name}"], value) <= 1e-5, name
    extras = str(got["extras"])
    assert "'commit_ms': [" in extras and "'commit_bytes': " in extras


def test_a_death_beyond_max_restarts_ends_the_job():
    # (--max_restarts 0, the default without --ckpt_dir, is test_stanza's killed FC node: the job ends)
    proc, out = _run("mixed_sgd", "hybrid", 2, ["--max_restarts=1"])       # dies every time it gets there
    output = proc.stdout + proc.stderr
    assert proc.returncode == 137, launch.tail(proc)
    assert output.count("rank 2 on localhost exited with status 137; stopping the other ranks") == 2
    assert "restart 1 of 1" in output and "restart 2" not in output
    assert "1 restart(s): rank 2 exited with status 137, resumed at step 4" in output
    assert not [f for f in os.listdir(out) if f.endswith(".npz")]


def test_restarts_need_checkpoints():
    import parallax_tf as ptf
    from parallax_tf import flags as ptf_flags
    with pytest.raises(ptf.ConfigError, match=r"--max_restarts=2: give a count >= 0, and --ckpt_dir"):
        ptf_flags.resolve(max_restarts=2)
    assert ptf_flags.resolve(max_restarts=0).max_restarts == 0


def _on_two_hosts(argv, timeout=400, ssh=False):
    return launch.on_emulated_hosts([launch.PYTHON, "tests/jobs/train_case.py", *argv], timeout=timeout, ssh=ssh)


def test_a_lost_host_is_left_out_and_the_job_goes_on_with_fewer_ranks():
    """Host h1 is lost at step 5 and the discovery script stops listing it: the restart goes on
    with h0's one rank from step 4's checkpoint (the plan re-made for one rank), and the result is
    single-device training on 2 ranks' batches for 4 steps, then on 1 rank's."""
    import sys
    ckpt, out = tempfile.mkdtemp(prefix="ptf-restart-"), tempfile.mkdtemp(prefix="ptf-restart-")
    discovery = f"{sys.executable} tests/jobs/discover_hosts.py {out} h0:1 h1:1"
    proc = _on_two_hosts(["--case=mixed_adagrad", f"--out={out}", "--log_every=0", f"--steps={STEPS}",
                          f"--ckpt_dir={ckpt}", f"--ckpt_every={EVERY}", "--lose_host=h1", f"--lose_host_at_step={DIE_AT}",
                          "--max_restarts=1", "--min_np=1", f"--host_discovery_script={discovery}"])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, launch.tail(proc)
    assert "restart 1 of 1: every rank starts again on 1 rank(s) of h0 (h1 left out) and resumes from the latest " \
           "checkpoint (step 4)" in output, launch.tail(proc)
    assert "1 restart(s): rank 1 exited with status 137, resumed at step 4 on 1 rank(s) of h0 (h1 left out)" in output
    got = np.load(os.path.join(out, "mixed_adagrad.rank0.npz"))
    assert int(got["global_step"]) == STEPS and int(got["start_step"]) == 4
    want = reference.train_single_device("mixed", "adagrad", [2] * 4 + [1] * (STEPS - 4), steps=STEPS)
    for name, value in want.items():
        assert reference.relative_error(got[f"var:{name}"], value) <= 1e-5, name


def test_a_restart_goes_on_only_with_min_np_ranks(monkeypatch, tmp_path, capsys):
    """The restart rule alone (the run itself is the lost-host test above): every run loses rank
    1; the discovery script lists h0 only."""
    from parallax_tf.runtime import launcher
    runs = []

    def run(command, hosts, num_proc, env, nics, server_ip, failure, **options):
        runs.append((hosts, num_proc))
        failure.update(rank=1, host="h1", status=137, user_error=False)
        return 137
    monkeypatch.setattr(launcher, "run", run)
    only_h0 = "echo h0:2"
    assert launcher.run_restarting(["job"], "h0:2,h1:2", 4, {}, {"lo"}, "127.0.0.1", 2, str(tmp_path), None,
                                   only_h0) == 137
    assert runs == [("h0:2,h1:2", 4)]
    assert "h1 did not come back: 2 rank(s) can start, fewer than --min_np=4; the job ends" in capsys.readouterr().err
    runs.clear()
    assert launcher.run_restarting(["job"], "h0:2,h1:2", 4, {}, {"lo"}, "127.0.0.1", 2, str(tmp_path), 2,
                                   only_h0) == 137
    assert runs == [("h0:2,h1:2", 4), ("h0:2", 2), ("h0:2", 2)]
    err = capsys.readouterr().err
    assert "2 restart(s): rank 1 exited with status 137, resumed at step 0 on 2 rank(s) of h0 (h1 left out); " \
           "rank 1 exited with status 137, resumed at step 0" in err
    assert launcher.run_restarting(["job"], "h0:2", 2, {}, {"lo"}, "127.0.0.1", 1, None, 3, only_h0) == 2
    assert "--min_np=3: give a rank count from 1 to the 2 the job starts with" in capsys.readouterr().err
    assert launcher.run_restarting(["job"], "h0:2", 2, {}, {"lo"}, "127.0.0.1", 1, None, 1, "exit 4") == 137
    assert "the host discovery script (exit 4) exited with status 4: no output; the job ends" in capsys.readouterr().err


def test_in_memory_commits_need_rank_0_on_the_launching_machine(monkeypatch):
    """The launcher keeps commits in its own /dev/shm: it offers them (PARALLAX_COMMIT_DIR) only
    when rank 0, which writes them, runs on the launching machine."""
    from parallax_tf.runtime import launcher, remote
    envs = []

    def run(command, hosts, num_proc, env, nics, server_ip, failure, **options):
        envs.append(env)
        return 0
    monkeypatch.setattr(launcher, "run", run)
    monkeypatch.setattr(remote, "remote_hosts", lambda names: {n for n in names if n != "here"})
    ssh = remote.Ssh()
    for hosts, offered in [("here:1,there:1", True), ("there:1,here:1", False)]:
        assert launcher.run_restarting(["job"], hosts, 2, {}, {"eth0"}, "10.0.0.1", ssh=ssh) == 0
        assert (launcher.COMMIT_DIR_ENV in envs[-1]) == offered, hosts
    assert launcher.run_restarting(["job"], "there:2", 2, {}, {"eth0"}, "10.0.0.1") == 0    # no ssh: all here
    assert launcher.COMMIT_DIR_ENV in envs[-1]


def test_two_hosts_reached_over_ssh_restart_on_the_same_hosts():
    """The launcher starts the ranks of two emulated hosts through ssh (an sshd on each host, hosts
    named by address, interfaces found by Horovod over ssh, as --host_slots does on real hosts) and
    restarts the job on the same host list. Rank 1 is host 1's first rank: the PS state of its
    host dies with it."""
    ckpt, out = tempfile.mkdtemp(prefix="ptf-restart-"), tempfile.mkdtemp(prefix="ptf-restart-")
    proc = _on_two_hosts(["--case=mixed_adagrad", f"--out={out}", "--log_every=0", f"--steps={STEPS}",
                          f"--ckpt_dir={ckpt}", f"--ckpt_every={EVERY}", f"--die_at_step={DIE_AT}", "--die_rank=1",
                          "--die_once", "--max_restarts=1"], ssh=True)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, launch.tail(proc)
    assert "rank 1 on 198.18.0.2 exited with status 137; stopping the other ranks" in output, launch.tail(proc)
    assert "1 restart(s): rank 1 exited with status 137, resumed at step 4" in output, launch.tail(proc)
    assert "HOROVOD_HOSTNAME" not in output      # the remote shell's note on the killed rank is dropped
    want = reference.train_single_device("mixed", "adagrad", 2, steps=STEPS)
    got = np.load(os.path.join(out, "mixed_adagrad.rank0.npz"))
    assert int(got["global_step"]) == STEPS and int(got["start_step"]) == 4
    for name, value in want.items():
        assert reference.relative_error(got[f"var:{name}"], value) <= 1e-5, name
