"""The launcher's touches of Horovod's runner beyond its public API, in one place.

Imports nothing but the standard library and Horovod: the launcher runs as a script and every
per-rank helper process Horovod spawns re-imports it (see launcher.py)."""
from __future__ import annotations


def quiet_rank_stop() -> None:
    """In a per-rank helper process (safe_shell_exec's middleman): stopping a rank's shell that
    ends by itself meanwhile is done, not an error. Horovod 0.28.1's
    terminate_executor_shell_and_children asks psutil for the shell's children after it checked
    that the shell exists; once the helper's main thread has reaped the shell, children() raises
    NoSuchProcess and that thread's traceback reaches the job's stderr (after a NaN's one line,
    when every rank ends at once)."""
    import psutil
    from horovod.runner.common.util import safe_shell_exec
    terminate = safe_shell_exec.terminate_executor_shell_and_children
    if getattr(terminate, "quiet_when_gone", False):
        return

    def terminate_unless_gone(pid):
        try:
            terminate(pid)
        except psutil.NoSuchProcess:
            pass
    terminate_unless_gone.quiet_when_gone = True
    # _exec_middleman reads this module global when its stop thread fires
    safe_shell_exec.terminate_executor_shell_and_children = terminate_unless_gone
