"""`python train.py --np N` outside any launcher: start N local ranks through Horovod's gloo
rendezvous on loopback (parallax_tf/runtime/launcher.py), stream their output and return the
job's exit status.

`import parallax_tf` does this before TensorFlow is imported when the command line asks for
ranks (launch_if_asked): the launching process then never imports TensorFlow, which takes
seconds and prints its start-up notices.

This process (the front end) holds a line to the launcher, and the launcher one to each rank
(lifeline.py): whatever ends one of them, SIGKILL included, ends the job below it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Optional

from parallax_tf.runtime import bind, lifeline, quiet

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher.py")
# The launcher's multiprocessing resource tracker outlives a launcher killed by SIGKILL, removes
# the semaphores it leaves and warns about them on the job's stderr: the ranks' own lines say why.
QUIET_RESOURCE_TRACKER = ("-W", "ignore:resource_tracker:UserWarning")
LAUNCHER_ENV = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
DEFAULT_RESTARTS = 3      # --max_restarts when the job checkpoints (--ckpt_dir); 0 otherwise


def under_launcher() -> bool:
    return any(k in os.environ for k in LAUNCHER_ENV)


def restarts_of(max_restarts: Optional[int], ckpt_dir: Optional[str]) -> int:
    """--max_restarts, whose default is DEFAULT_RESTARTS where there are checkpoints to resume from."""
    return max_restarts if max_restarts is not None else (DEFAULT_RESTARTS if ckpt_dir else 0)


def restart_options(args) -> dict:
    """What a launcher needs of a job's command line to restart it: --max_restarts (with its
    default), --ckpt_dir, --min_np, --host_discovery_script."""
    restarts, ckpt_dir = flag_value(args, "max_restarts"), flag_value(args, "ckpt_dir")
    min_np = flag_value(args, "min_np")
    return {"max_restarts": restarts_of(int(restarts) if restarts and restarts.isdigit() else None, ckpt_dir),
            "ckpt_dir": ckpt_dir, "min_np": int(min_np) if min_np and min_np.isdigit() else None,
            "discovery": flag_value(args, "host_discovery_script")}


def host_options(args) -> dict:
    """Where a job's command line asks its ranks to run: --host_slots, --ssh_port, --ssh_identity_file."""
    port = flag_value(args, "ssh_port")
    return {"hosts": flag_value(args, "host_slots"), "ssh_port": int(port) if port and port.isdigit() else None,
            "ssh_identity_file": flag_value(args, "ssh_identity_file")}


def flag_value(args, name: str) -> Optional[str]:
    """The value of --name in a command line (absl's --name=V or --name V), None if absent."""
    found = None
    for i, arg in enumerate(args):
        if arg == "--":
            break
        key, eq, value = arg.partition("=")
        if key in (f"--{name}", f"-{name}"):
            found = value if eq else (args[i + 1] if i + 1 < len(args) else "")
    return found


def requested_ranks(args) -> int:
    """--np N of a command line that trains (not --plan_only); 0 when it asks for no ranks or
    says it unclearly (absl then parses it and the run says what is wrong)."""
    count = flag_value(args, "np") or ""
    plan_only = False
    for arg in args:
        if arg == "--":
            break
        name, eq, value = arg.partition("=")
        if name in ("--plan_only", "-plan_only"):
            plan_only = not eq or value.lower() in ("true", "1")
        elif name in ("--noplan_only", "-noplan_only"):
            plan_only = False
    return 0 if plan_only or not count.isdigit() else int(count)


# absl's spellings of its help flags (one dash or two) -> how much help they ask for
HELP_FLAGS = {"help": "short", "h": "short", "?": "short", "helpshort": "short", "helpfull": "full"}


def help_asked(argv) -> Optional[str]:
    """"short" or "full" when a command line asks for help before its `--`, else None."""
    for arg in argv[1:]:
        if arg == "--":
            return None
        name, eq, value = arg.lstrip("-").partition("=")
        if arg.startswith("-") and name in HELP_FLAGS and (not eq or value.lower() in ("true", "1")):
            return HELP_FLAGS[name]
    return None


def launch_if_asked(argv) -> None:
    """Starts the ranks and exits with the job's status when this command line asks for more
    than one rank and no launcher started it. A rank that parallax_tf's launcher started holds
    its line to that launcher instead: it stops once the launcher is gone."""
    if under_launcher():
        lifeline.watch_launcher()
        return
    if sys.flags.interactive or not getattr(sys, "orig_argv", None):
        return
    main = sys.modules.get("__main__")
    if main is None or not getattr(main, "__file__", None):
        return                         # python -c, a notebook: run() launches as before
    count = requested_ranks(argv[1:])
    if count > 1 and not help_asked(argv):       # help is printed here, by the flags, and ends the program
        sys.exit(launch_local(count, quiet.verbose_in(argv), **restart_options(argv[1:]), **host_options(argv[1:])))


def launch_local(num_ranks: int, verbose: bool = False, max_restarts: int = 0, ckpt_dir: Optional[str] = None,
                 min_np: Optional[int] = None, discovery: Optional[str] = None, hosts: Optional[str] = None,
                 ssh_port: Optional[int] = None, ssh_identity_file: Optional[str] = None) -> int:
    """Starts the launcher for `num_ranks` ranks of this command line (on this machine, or on
    `hosts`) and returns the job's exit status."""
    # sys.orig_argv keeps `-m package.module`, so module entry points relaunch as they started.
    argv = list(sys.orig_argv[1:])
    options = {"--max_restarts": max_restarts, "--ckpt_dir": ckpt_dir, "--min_np": min_np,
               "--host_discovery_script": discovery, "--host_slots": hosts, "--ssh_port": ssh_port,
               "--ssh_identity_file": ssh_identity_file}
    # run by path: see launcher.py for why it must not be started with -m
    job_line = lifeline.JobLine()
    command = [sys.executable, *QUIET_RESOURCE_TRACKER, LAUNCHER, "--np", str(num_ranks),
               "--front_end_fd", str(job_line.launcher_fd())] + \
        [part for name, value in options.items() if value not in (None, "") for part in (name, str(value))] + \
        (["--verbose"] if verbose else []) + ["--", sys.executable, *argv]
    from parallax_tf.runtime.exit import EXPECT_RUN_ENV
    env = bind.preload_env(quiet.environment(dict(os.environ, PYTHONUNBUFFERED="1", **{EXPECT_RUN_ENV: "1"}), verbose))
    try:
        proc = subprocess.Popen(command, env=env, start_new_session=True, pass_fds=(job_line.launcher_fd(),))
    finally:
        job_line.launched()
    # The ranks run in their own session: a SIGTERM to this process must reach them too, or
    # they outlive it. The launcher stops its ranks on SIGTERM; its exit status is returned.
    previous = signal.signal(signal.SIGTERM, lambda *_: os.killpg(proc.pid, signal.SIGTERM))
    try:
        status = proc.wait()
        return 128 - status if status < 0 else status
    except KeyboardInterrupt:      # Ctrl-C: the launcher stops its ranks and says it was SIGINT
        os.kill(proc.pid, signal.SIGINT)
        try:
            return proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        return 128 + signal.SIGINT
    finally:
        signal.signal(signal.SIGTERM, previous)
        job_line.wait_and_clean_up(proc.pid, proc.returncode)
