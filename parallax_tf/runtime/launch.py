"""`python train.py --np N` outside any launcher: start N local ranks through Horovod's gloo
rendezvous on loopback (parallax_tf/runtime/launcher.py), stream their output and return the
job's exit status."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from parallax_tf.runtime import bind, quiet

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher.py")


def launch_local(num_ranks: int, verbose: bool = False) -> int:
    # sys.orig_argv keeps `-m package.module`, so module entry points relaunch as they started.
    argv = list(sys.orig_argv[1:])
    # run by path: see launcher.py for why it must not be started with -m
    command = [sys.executable, LAUNCHER, "--np", str(num_ranks), "--", sys.executable, *argv]
    env = bind.preload_env(quiet.environment(dict(os.environ, PYTHONUNBUFFERED="1"), verbose))
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    # The ranks run in their own session: a SIGTERM to this process must reach them too, or
    # they outlive it. The launcher stops its ranks on SIGTERM; its exit status is returned.
    previous = signal.signal(signal.SIGTERM, lambda *_: os.killpg(proc.pid, signal.SIGTERM))
    try:
        return proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
