"""A rank killed mid-training: the job stops fast, names the lost rank, leaves nothing behind,
and a restart resumes from the last checkpoint and still matches single-device training."""
import os
import re
import signal
import socket
import subprocess
import tempfile
import time

import numpy as np
import pytest

from tests import launch, reference
from parallax_tf.runtime.launch import LAUNCHER

SIZE, DIE_AT, EVERY = 3, 12, 5


def _bindable(address: str) -> bool:
    """Free for a new server: nothing listens there (TIME_WAIT leftovers of closed connections
    do not count; servers bind with SO_REUSEADDR, as this probe does)."""
    host, port = address.rsplit(":", 1)
    listening = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True).stdout
    if listening.strip():
        return False
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, int(port)))
            return True
        except OSError:
            return False


@pytest.mark.parametrize("victim", [2, 0], ids=["plain_worker", "ps_host"])
def test_sigkill_one_rank(victim):
    ckpt, out = tempfile.mkdtemp(prefix="ptf-fault-"), tempfile.mkdtemp(prefix="ptf-fault-")
    flags = ["tests/jobs/train_case.py", "--case=mixed_adagrad", f"--out={out}", "--log_every=0",
             f"--ckpt_dir={ckpt}", f"--ckpt_every={EVERY}"]
    proc = launch.run_ranks(SIZE, flags + ["--steps=60", f"--die_at_step={DIE_AT}", f"--die_rank={victim}"],
                            timeout=150)
    stopped = time.time() - float(open(os.path.join(out, "died_at")).read())
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert stopped < 30, f"the job took {stopped:.0f}s to stop after rank {victim} died"
    assert f"Process {victim} exit with status code 137" in output      # the launcher names it too
    for rank in set(range(SIZE)) - {victim}:
        assert re.search(rf"parallax_tf rank {rank}: .*lost: [^\n]*rank {victim} \(", output), launch.tail(proc)
    # nothing left running, nothing left listening
    assert subprocess.run(["pgrep", "-f", out], capture_output=True).returncode == 1
    ports = re.findall(r"parallax_tf rank \d+: worker (\S+)$", output, re.M)   # one server per rank
    assert len(ports) == SIZE and all(_bindable(a) for a in ports)
    # the restart loses at most one checkpoint interval and ends where an uninterrupted run would
    resumed = launch.run_ranks(SIZE, flags + ["--steps=15"], timeout=150)
    assert resumed.returncode == 0, launch.tail(resumed)
    result = np.load(os.path.join(out, "mixed_adagrad.rank0.npz"))
    assert DIE_AT - EVERY <= int(result["start_step"]) <= DIE_AT
    want = reference.train_single_device("mixed", "adagrad", SIZE, steps=15)
    for name, value in want.items():
        assert reference.relative_error(result[f"var:{name}"], value) <= 1e-5, name


def test_sigterm_to_the_launcher_stops_every_rank_and_its_caller():
    """tools.bench runs strategies one after another through the launcher: a SIGTERM must stop
    the ranks it started and the caller, not only the launcher's own process."""
    marks = tempfile.mkdtemp(prefix="ptf-sigterm-")
    rank = ("import os, time; open(os.path.join(%r, 'rank' + os.environ['HOROVOD_RANK']), 'w')"
            ".write(str(os.getpid())); time.sleep(600)" % marks)
    caller = ("import sys; from parallax_tf.runtime import launcher; "
              "launcher.main(['--np', '2', '--', sys.executable, '-c', %r]); "
              "print('the caller went on')" % rank)
    proc = subprocess.Popen([launch.PYTHON, "-c", caller], cwd=launch.ROOT, env=dict(os.environ, PYTHONPATH=launch.ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 120
        while len(os.listdir(marks)) < 2 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        pids = [int(open(os.path.join(marks, f)).read()) for f in sorted(os.listdir(marks))]
        assert len(pids) == 2, f"the ranks did not start: {proc.poll()}"
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert proc.returncode == 143, err
    assert "stopped every rank on SIGTERM" in err
    assert "the caller went on" not in out
    time.sleep(1)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", pid


def test_a_rank_stops_when_its_launcher_is_gone():
    """A rank started through ssh outlives a killed launcher (its ssh client goes, the rank does
    not): the watchdog sees the launcher's rendezvous server stop answering and ends the rank."""
    rank = """if True:
        import socket, sys, time
        from parallax_tf.runtime import watchdog
        def listening():
            s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(); return s
        launcher, peer = listening(), listening()
        where = lambda s: "127.0.0.1:%d" % s.getsockname()[1]
        watchdog.Watchdog(0, {0: "unused", 1: where(peer)}, interval=0.2, launcher=where(launcher)).start()
        time.sleep(1)
        print("alive", flush=True)
        launcher.close()
        time.sleep(20)
        print("still running", flush=True)"""
    began = time.time()
    proc = subprocess.run([launch.PYTHON, "-c", rank], cwd=launch.ROOT, env=dict(os.environ, PYTHONPATH=launch.ROOT),
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout == "alive\n", launch.tail(proc)
    assert proc.returncode == 77, launch.tail(proc)
    assert re.search(r"the launcher that started this rank \(127\.0\.0\.1:\d+\) is gone; stopping this rank",
                     proc.stderr), launch.tail(proc)
    assert time.time() - began < 20


def test_ctrl_c_is_named_sigint_and_stops_every_rank():
    """Ctrl-C reaches the user's process (the launcher runs in a session of its own): it passes
    SIGINT on, and the launcher names it so, without a rank's word of a lost peer."""
    marks = tempfile.mkdtemp(prefix="ptf-sigint-")
    script = os.path.join(marks, "sleeper.py")
    with open(script, "w") as f:
        f.write(f"import os, sys, time\nsys.path.insert(0, {launch.ROOT!r})\nimport parallax_tf\n"
                f"open(os.path.join({marks!r}, 'rank' + os.environ['HOROVOD_RANK']), 'w').write(str(os.getpid()))\n"
                "time.sleep(600)\n")
    # started as from a terminal: with SIGINT's default action, whatever runs the suite (a
    # shell's background job, nohup: SIGINT ignored, which a child inherits)
    proc = subprocess.Popen([launch.PYTHON, script, "--np", "2"], cwd=launch.ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=launch.ROOT),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 120
        while len([f for f in os.listdir(marks) if f.startswith("rank")]) < 2 and time.time() < deadline \
                and proc.poll() is None:
            time.sleep(0.2)
        pids = [int(open(os.path.join(marks, f)).read()) for f in sorted(os.listdir(marks)) if f.startswith("rank")]
        assert len(pids) == 2, f"the ranks did not start: {proc.poll()}"
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError("the job did not end within 60 s of SIGINT:\n" + _processes_of(marks)) from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["parallax_tf launcher: stopped every rank on SIGINT (Ctrl-C)"], err
    time.sleep(1)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z", pid


def _processes_of(marks: str) -> str:
    """The job's processes still alive (the user's, the launcher, Horovod's helpers, the ranks)
    and, where py-spy is installed, their Python stacks: what a job that did not end waits on."""
    listing = subprocess.run(["ps", "-ww", "-eo", "pid,ppid,sid,stat,etimes,args"], capture_output=True, text=True).stdout
    alive = [line for line in listing.splitlines() if marks in line or "launcher.py" in line or "multiprocessing" in line]
    stacks = []
    spy = os.path.join(os.path.dirname(launch.PYTHON), "py-spy")
    for line in alive if os.path.exists(spy) else []:
        dump = subprocess.run([spy, "dump", "--pid", line.split()[0]], capture_output=True, text=True, timeout=30)
        stacks.append(dump.stdout[-3000:])
    return "\n".join(alive + stacks)


def test_a_rank_helper_stopping_a_shell_that_ended_meanwhile_prints_nothing():
    """Horovod's per-rank helper re-imports the launcher script as __mp_main__ and there its stop
    thread's psutil call on a shell already reaped (both ranks ending on a NaN) is quiet: it
    raised NoSuchProcess, whose traceback followed the NaN's one line. Other failures still show."""
    helper = f"""if True:
        import runpy, sys, psutil
        sys.path.insert(0, {os.path.dirname(LAUNCHER)!r})
        from horovod.runner.common.util import safe_shell_exec
        def reaped(pid):
            raise psutil.NoSuchProcess(pid)       # what children() raises once the shell is reaped
        safe_shell_exec.terminate_executor_shell_and_children = reaped
        runpy.run_path({LAUNCHER!r}, run_name="__mp_main__")
        safe_shell_exec.terminate_executor_shell_and_children(4242)
        print("stopped quietly", flush=True)
        def denied(pid):
            raise psutil.AccessDenied(pid)
        safe_shell_exec.terminate_executor_shell_and_children = denied
        runpy.run_path({LAUNCHER!r}, run_name="__mp_main__")
        safe_shell_exec.terminate_executor_shell_and_children(4242)"""
    proc = subprocess.run([launch.PYTHON, "-c", helper], capture_output=True, text=True, timeout=60)
    assert proc.stdout == "stopped quietly\n", launch.tail(proc)
    assert proc.returncode == 1 and "psutil.AccessDenied" in proc.stderr, launch.tail(proc)
    assert "NoSuchProcess" not in proc.stderr, launch.tail(proc)


def test_a_stopped_watchdog_lets_the_run_end_at_once():
    """stop() wakes the watchdog's wait (a select on its signal pipe) instead of waiting out
    its interval: every run's end waited for it (0.5 s on average at the default 1 s)."""
    import threading
    from parallax_tf.runtime import watchdog
    assert threading.current_thread() is threading.main_thread()     # where it watches SIGTERM's pipe
    dog = watchdog.Watchdog(0, {0: "unused"}, interval=30).start()
    time.sleep(0.2)                  # in its select
    began = time.monotonic()
    dog.stop()
    assert time.monotonic() - began < 5 and not dog._thread.is_alive()
