"""Ranks leave every run, and the process, within the teardown bound: the TF1 tutorial's shape
(tf.data inside model_fn) trained many times back to back at 2 ranks, the last run with rank 0
closing its session only after rank 1 could have left (tests/jobs/exit_job.py)."""
import os
import re
import signal
import subprocess
import time
import uuid

from parallax_tf.runtime import teardown
from tests import launch

RUNS, TIMEOUT_S = 10, 40
# rank 0 closes, resets, then both pass the barrier: at most two bounds, whatever each rank waits on
TEARDOWN_LIMIT_S = 2 * teardown.bound_s(TIMEOUT_S)
JOB_LIMIT_S = 120        # about 25s on 2 idle cores


def _stop_leftovers(marker: str) -> None:
    """Ends the processes of a job that outlived its limit (its launcher runs in a session of
    its own), found by the marker in their environment."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def test_every_run_and_the_process_exit_within_bounds():
    marker = f"PARALLAX_EXIT_TEST={uuid.uuid4().hex}"
    began = time.monotonic()
    try:
        proc = launch.run_ranks(2, ["tests/jobs/exit_job.py", "--np=2", f"--runs={RUNS}", "--steps=5", "--log_every=0",
                                    f"--timeout_s={TIMEOUT_S}"], launcher="python", timeout=JOB_LIMIT_S,
                                env=dict([marker.split("=")]))
    except subprocess.TimeoutExpired as err:
        _stop_leftovers(marker)
        seen = [_text(err.stdout), _text(err.stderr)]
        tail = "\n".join(line for part in seen for line in part.splitlines()[-20:])
        raise AssertionError(f"the job did not exit within {JOB_LIMIT_S}s: a rank hangs on its way out\n{tail}") \
            from None
    took = time.monotonic() - began
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, launch.tail(proc)
    assert "teardown:" not in output, launch.tail(proc)      # no step gave up on its bound
    times = {(int(r), int(i)): float(s) for r, i, s in re.findall(r"teardown rank (\d) run (\d+): ([\d.]+)", output)}
    assert sorted(times) == [(r, i) for r in (0, 1) for i in range(RUNS)], launch.tail(proc)
    slow = {key: s for key, s in times.items() if s > TEARDOWN_LIMIT_S}
    assert not slow, f"teardown over {TEARDOWN_LIMIT_S}s (rank, run): {slow}"
    # in the last run rank 1 stayed until rank 0, held in its session's close, had reset
    assert times[(1, RUNS - 1)] >= 1.0, times
    print(f"{RUNS} runs at 2 ranks in {took:.0f}s; longest teardown {max(times.values()):.2f}s")


def test_the_exit_skips_collecting_what_tensorflows_import_made():
    """After the process's own atexit handlers, the objects alive are frozen, so the interpreter's
    exit frees them by reference count instead of collecting them (0.7 s per rank otherwise)."""
    probe = ("import atexit, gc\n"
             "atexit.register(lambda: print('at exit:', gc.isenabled(), gc.get_freeze_count() > 100000))\n"
             "import parallax_tf\n")
    proc = subprocess.run([launch.PYTHON, "-c", probe], cwd=launch.ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=launch.ROOT))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "at exit: False True", proc.stdout
