"""No process of a job outlives the one that started it (parallax_tf/runtime/lifeline.py): a
2-rank job started through the real front end (`python tests/jobs/endless_job.py --np 2`) and
killed while its ranks train leaves no process and no temporary folder behind within
STOP_LIMIT_S, and the one left to speak says why in one line."""
import json
import os
import shutil
import signal
import subprocess
import time
import uuid

import pytest

from tests import launch

MARK_ENV = "PARALLAX_ORPHANS_TEST"     # in the environment of every process of the job
START_LIMIT_S = 120        # until both ranks train: about 10s on 2 idle cores
STOP_LIMIT_S = 15          # from the kill until nothing of the job is left


class _Job:
    """A 2-rank job of tests/jobs/endless_job.py, its output in `log`; it trains until stopped."""

    def __init__(self, folder):
        self.marker, self.out, self.log = uuid.uuid4().hex, str(folder), os.path.join(str(folder), "output")
        with open(self.log, "w") as log:
            self.front_end = subprocess.Popen(
                [launch.PYTHON, "tests/jobs/endless_job.py", "--np=2", "--steps=100000", "--log_every=0",
                 "--commit_every=5", f"--out={self.out}"],
                cwd=launch.ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                # a terminal's process takes SIGHUP's default (this suite may run under nohup)
                preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
                env=dict(os.environ, PYTHONPATH=launch.ROOT, TF_CPP_MIN_LOG_LEVEL="2", **{MARK_ENV: self.marker}))
        self.folders, self.launcher = [], None

    def wait_until_training(self) -> None:
        """Both ranks train: their temporary folders and the launcher's pid are known."""
        deadline = time.monotonic() + START_LIMIT_S
        marks = [os.path.join(self.out, f"training.rank{rank}") for rank in (0, 1)]
        while not all(map(os.path.exists, marks)):
            assert self.front_end.poll() is None, f"the job ended before training:\n{self.output()}"
            assert time.monotonic() < deadline, f"the ranks did not train within {START_LIMIT_S}s:\n{self.output()}"
            time.sleep(0.1)
        with open(marks[0]) as mark:
            seen = json.load(mark)
        self.folders = [seen["job_dir"], seen["commit_dir"]]
        children = subprocess.run(["pgrep", "-P", str(self.front_end.pid)], capture_output=True, text=True).stdout
        self.launcher = int(children.split()[0])

    def processes(self) -> dict:
        """pid -> command line of every live process of the job (zombies are gone but unreaped)."""
        found = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as environ:
                    if f"{MARK_ENV}={self.marker}".encode() not in environ.read():
                        continue
                with open(f"/proc/{pid}/stat") as stat:
                    if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                        continue
                with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                    found[int(pid)] = cmdline.read().replace(b"\0", b" ").decode(errors="replace")[:160]
            except OSError:
                pass
        return found

    def left_after(self, began: float) -> tuple:
        """(seconds from `began` until no process and no folder of the job was left, or None, what was left)."""
        while time.monotonic() - began < STOP_LIMIT_S:
            self.front_end.poll()
            if not self.processes() and not any(map(os.path.exists, self.folders)):
                return time.monotonic() - began, {}
            time.sleep(0.1)
        return None, {"processes": self.processes(), "folders": [f for f in self.folders if os.path.exists(f)]}

    def output(self) -> str:
        with open(self.log) as log:
            return log.read()

    def end(self) -> None:
        """Whatever the test found, nothing of this job outlives it."""
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if self.front_end.poll() is None:
            self.front_end.wait(timeout=10)
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def training_job(tmp_path):
    """Starts a job and returns it once its ranks train; nothing of it outlives the test."""
    started = []

    def start() -> _Job:
        started.append(_Job(tmp_path))
        started[-1].wait_until_training()
        return started[-1]
    yield start
    for job in started:
        job.end()


def _clean(output: str) -> None:
    for noise in ("Traceback", "leaked semaphore", "resource_tracker"):
        assert noise not in output, output


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGHUP], ids=["SIGKILL", "SIGHUP"])
def test_a_killed_front_end_takes_its_job_along(training_job, signum):
    """The terminal closed (SIGHUP), or the front end killed: its launcher, in a session of its
    own, says so once, stops the ranks and leaves with its folders."""
    job = training_job()
    began = time.monotonic()
    os.kill(job.front_end.pid, signum)
    took, left = job.left_after(began)
    print(f"front end killed by {signal.Signals(signum).name}: nothing left after {took}s")
    assert took is not None, f"{STOP_LIMIT_S}s after the front end's {signal.Signals(signum).name}: {left}\n" \
                             f"{job.output()}"
    output = job.output()
    said = f"parallax_tf: the front end (pid {job.front_end.pid}) is gone: stopping the job\n"
    assert output.count(said) == 1, output
    _clean(output)


def test_a_killed_launcher_takes_its_ranks_along(training_job):
    """The launcher killed by SIGKILL: each rank says so and exits, the folders the launcher
    could not remove are gone all the same, and the front end, last, says what happened and
    exits with the launcher's 128 + 9."""
    job = training_job()
    began = time.monotonic()
    os.kill(job.launcher, signal.SIGKILL)
    took, left = job.left_after(began)
    print(f"launcher killed by SIGKILL: nothing left after {took}s")
    assert took is not None, f"{STOP_LIMIT_S}s after the launcher's SIGKILL: {left}\n{job.output()}"
    assert job.front_end.wait(timeout=STOP_LIMIT_S) == 128 + signal.SIGKILL
    output = job.output()
    for rank in (0, 1):
        said = f"parallax_tf rank {rank}: the launcher (pid {job.launcher}) is gone: stopping\n"
        assert output.count(said) == 1, output
    assert output.endswith(f"parallax_tf: the launcher (pid {job.launcher}) was killed by SIGKILL; "
                           "every rank has stopped\n"), output
    _clean(output)
