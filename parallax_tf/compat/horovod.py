"""Every name of Horovod's runner that the launcher uses beyond horovodrun's command line, in
one place, each pinned (PINNED, checked by tests/test_compat.py): Horovod 0.28.1 is its last
release, so a name that moves is found here rather than in a job that will not start. The rest
of the toolkit uses horovod.tensorflow's public API only.

Imports nothing but the standard library and Horovod: the launcher runs as a script and every
per-rank helper process Horovod spawns re-imports it (see runtime/launcher.py); there
runtime/remote.py loads this file by its path, without importing parallax_tf."""
from __future__ import annotations

import importlib
import os
import time
from typing import Callable, List, Tuple

# (module, name, what the launcher uses it for)
PINNED: List[Tuple[str, str, str]] = [
    ("horovod.runner.gloo_run", "launch_gloo", "the ranks' gloo launch (launch_gloo)"),
    ("horovod.runner.gloo_run", "register_shutdown_event", "swapped for our stop event (launch_gloo)"),
    ("horovod.runner.common.util.safe_shell_exec", "execute", "a rank's helper process (execute)"),
    ("horovod.runner.common.util.safe_shell_exec", "terminate_executor_shell_and_children",
     "quiet on a shell already gone, patient once the launcher is gone (install_rank_stop)"),
    ("horovod.runner.launch", "_check_all_hosts_ssh_successful", "horovodrun's ssh check (ssh_reaches)"),
    ("horovod.runner.util.network", "filter_local_addresses", "the hosts that are not this one (remote_of)"),
    ("horovod.runner.util.remote", "get_remote_command", "a rank's command over ssh (ssh_command)"),
    ("horovod.runner.driver.driver_service", "get_common_interfaces",
     "the hosts' common interfaces (common_interfaces)"),
    ("horovod.runner.common.util.settings", "Settings", "the same"),
    ("horovod.runner.common.util.secret", "make_secret_key", "the same"),
    ("horovod.runner.common.util.timeout", "Timeout", "the same"),
]


def missing() -> List[str]:
    """The pinned names this Horovod does not have, as module.name."""
    gone = []
    for module, name, _ in PINNED:
        try:
            found = hasattr(importlib.import_module(module), name)
        except ImportError:
            found = False
        if not found:
            gone.append(f"{module}.{name}")
    return gone


def launch_gloo(command, exec_rank: Callable, settings, nics, env, server_ip: str, stop_event=None) -> None:
    """Horovod's gloo launch of `command`'s ranks, each started by exec_rank(cmd, slot, events).
    With `stop_event`, that event stops the ranks instead of the SIGINT/SIGTERM handler Horovod
    would install (and leave behind) for its own."""
    from horovod.runner import gloo_run
    own_event = gloo_run.register_shutdown_event
    if stop_event is not None:
        gloo_run.register_shutdown_event = lambda: stop_event
    try:
        gloo_run.launch_gloo(command, exec_rank, settings, nics, env, server_ip)
    finally:
        gloo_run.register_shutdown_event = own_event


def execute(cmd: str, events, stdout, stderr) -> int:
    """One rank's shell command through Horovod's per-rank helper process: stopped when any of
    `events` is set; its output to the given streams; returns its exit status."""
    from horovod.runner.common.util import safe_shell_exec
    return safe_shell_exec.execute(cmd, events=events, stdout=stdout, stderr=stderr)


def ssh_reaches(hosts: List[str], port, identity_file) -> bool:
    """Whether ssh reaches every host without a password (horovodrun's own check)."""
    from horovod.runner import launch
    return launch._check_all_hosts_ssh_successful(hosts, port, identity_file, fn_cache=None)


def remote_of(names: List[str]) -> List[str]:
    """The host names that are not addresses of this machine."""
    from horovod.runner.util import network
    return network.filter_local_addresses(names)


def ssh_command(command: str, host: str, port, identity_file) -> str:
    """`command` (one shell word) run on `host` through ssh, as horovodrun runs a remote rank."""
    from horovod.runner.util.remote import get_remote_command
    return get_remote_command(command, host=host, port=port, identity_file=identity_file)


def common_interfaces(names: List[str], remote: List[str], port, identity_file, timeout_s: float):
    """The network interfaces every host of `names` has and routes, found by Horovod's driver
    service over ssh (horovodrun's own discovery); raises what Horovod raises when there is none."""
    from horovod.runner.common.util import secret, settings, timeout
    from horovod.runner.driver import driver_service
    found = settings.Settings(
        verbose=0, ssh_port=port, ssh_identity_file=identity_file, key=secret.make_secret_key(),
        start_timeout=timeout.Timeout(timeout_s, message="Timed out waiting for {activity}: the hosts' "
                                      "interfaces could not be compared"),
        num_proc=len(names), hosts=",".join(names), nics=None)
    return driver_service.get_common_interfaces(found, names, remote)


def install_rank_stop(launcher_gone_grace_s: float) -> None:
    """In a per-rank helper process (safe_shell_exec's middleman), how it stops its rank's shell.

    Quiet when the shell ends by itself meanwhile: Horovod 0.28.1's
    terminate_executor_shell_and_children asks psutil for the shell's children after it checked
    that the shell exists; once the helper's main thread has reaped the shell, children() raises
    NoSuchProcess and that thread's traceback reaches the job's stderr (after a NaN's one line,
    when every rank ends at once).

    Patient when the launcher is gone (this helper's parent changed): Horovod would SIGSTOP the
    rank at once and kill it seconds later, before it could say why. The rank notices by itself
    (runtime/lifeline.py), says so and exits; the helper, which exits with its shell, stops it
    only after `launcher_gone_grace_s`."""
    import psutil
    from horovod.runner.common.util import safe_shell_exec
    terminate = safe_shell_exec.terminate_executor_shell_and_children
    if getattr(terminate, "parallax_rank_stop", False):
        return
    launcher = os.getppid()

    def stop_rank_shell(pid):
        if os.getppid() != launcher:
            time.sleep(launcher_gone_grace_s)
        try:
            terminate(pid)
        except psutil.NoSuchProcess:
            pass
    stop_rank_shell.parallax_rank_stop = True
    # _exec_middleman reads this module global when its stop thread or its parent-death thread fires
    safe_shell_exec.terminate_executor_shell_and_children = stop_rank_shell
