"""Starting real ranks from a test, always with a time limit."""
from __future__ import annotations

import os
import subprocess
import sys

from parallax_tf.runtime import bind

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
# horovodrun without its build probe: before each launch it imports Horovod's TensorFlow extension
# in a new process to learn whether Gloo was built, which costs TensorFlow's import (3 s) per
# job. The set-up builds Gloo (`python -m parallax_tf check` says so); the probed horovodrun
# runs in test_fit's 3-rank job.
HOROVODRUN_WITHOUT_PROBE = ("import sys; from horovod.runner import launch; "
                            "launch.gloo_built = lambda verbose=False: True; sys.exit(launch.run_commandline())")


def run_ranks(np_: int, argv, launcher: str = "horovodrun", timeout: int = 600, env=None, preload=True):
    """Runs `python argv...` on np_ real ranks and returns the CompletedProcess (never hangs).
    With `preload`, ranks start with the bind shim loaded, as parallax_tf's own launcher starts
    them; without it each rank re-executes itself to load it."""
    if launcher in ("horovodrun", "horovodrun_probed"):
        start = ["-m", "horovod.runner.launch"] if launcher == "horovodrun_probed" else ["-c", HOROVODRUN_WITHOUT_PROBE]
        command = [PYTHON, *start, "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", PYTHON, *argv]
    elif launcher == "mpirun":
        command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np_),
                   "-x", "PYTHONPATH", "-x", "PATH", PYTHON, *argv]
    else:
        command = [PYTHON, *argv]
    full_env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
                    PARALLAX_PRINT_ADDRESSES="1")
    if preload:
        full_env = bind.preload_env(full_env)
    full_env.update(env or {})
    return subprocess.run(command, cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout, start_new_session=True)


def on_emulated_hosts(command, hosts: int = 2, timeout: int = 400, ssh: bool = False, env=None):
    """`command` run by tools.cluster on `hosts` emulated hosts; returns the CompletedProcess
    (never hangs)."""
    return subprocess.run([PYTHON, "-m", "tools.cluster", f"--hosts={hosts}", f"--ssh={ssh}", "--", *command],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout, start_new_session=True,
                          env=dict(os.environ, PYTHONPATH=ROOT, **(env or {})))


def tail(proc, lines: int = 60) -> str:
    return "\n".join((proc.stdout + "\n" + proc.stderr).splitlines()[-lines:])
