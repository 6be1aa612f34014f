"""A rank's way out of a run, every step bounded: closing its session, freeing the run's state
on the servers, Horovod's shutdown at exit.

TF's reset (Session.reset) frees the run's container on every server of the job, whichever rank
asks (it ignores device filters): the master sends CleanupAll to each worker with gRPC's
wait-for-ready and no deadline, so a reset that reaches the server of a rank that has already
exited waits for it forever. Hence rank 0 alone resets, and no rank leaves before it is done.

TF and Horovod bound none of these waits themselves. A step that outlives its bound stops the
rank with one line naming it (status STALLED_EXIT), and a barrier broken by a peer that left
with one saying so (LOST_RANK_EXIT), instead of leaving the rank hanging after its work is done."""
from __future__ import annotations

import atexit
import os
import re
import sys
import threading
from typing import Callable

from parallax_tf.runtime import rank_objects
from parallax_tf.runtime.watchdog import LOST_RANK_EXIT, STALLED_EXIT

_EXIT_BOUND = {}     # rank and seconds of the bound on Horovod's shutdown at exit, once registered


def bound_s(timeout_s: int) -> int:
    """How long one teardown step may take: closing a session waits for tf.data's threads
    (seconds), the barrier for the slowest peer's close."""
    return max(10, timeout_s // 4)


def finish(sess, target: str, run_id: str, rank: int, size: int, timeout_s: int, reset: bool) -> None:
    """Closes this rank's session; with `reset` (the run ended with every rank alive and past
    the barrier after reading), frees the run's container on every server of the job."""
    seconds = bound_s(timeout_s)
    bounded("Session.close", seconds, rank, sess.close)
    if not reset:
        return
    try:
        if rank == 0:
            import tensorflow as tf
            bounded("Session.reset", seconds, rank, lambda: tf.compat.v1.Session.reset(target, [run_id]))
    finally:
        if size > 1:    # nobody stops its server before the reset has reached it (rank 0: close, then reset)
            _barrier(rank, 2 * seconds)


def _barrier(rank: int, seconds: float) -> None:
    what = "the barrier after Session.reset"
    try:
        bounded(what, seconds, rank, lambda: rank_objects.allgather(rank, name="parallax_teardown"))
    except Exception as err:    # noqa: BLE001  (Horovod stopped: a peer left before everyone got here)
        said = re.sub(r"\{\{.*?\}\}", "", str(err)).strip().split(". ")[0][:160] or type(err).__name__
        give_up(rank, f"{what} failed, a peer has left ({said})", LOST_RANK_EXIT)


def bounded(what: str, seconds: float, rank: int, call: Callable[[], object]) -> None:
    """Runs `call`, re-raising its error; if it has not returned after `seconds`, says so in one
    line and ends this process. TF and Horovod release the GIL while they wait, so the join
    below times out even when the call never returns."""
    failure = []

    def run():
        try:
            call()
        except BaseException as err:    # noqa: BLE001  (re-raised in the caller's thread)
            failure.append(err)
    worker = threading.Thread(target=run, name="parallax-teardown", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        give_up(rank, f"{what} did not finish within {seconds:.0f}s")
    if failure:
        raise failure[0]


def give_up(rank: int, why: str, status: int = STALLED_EXIT) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os.write(2, f"parallax_tf rank {rank}: teardown: {why}; exiting\n".encode())
    os._exit(status)


def bound_exit(rank: int, timeout_s: int) -> None:
    """Bounds Horovod's shutdown at this process's exit. Registered after hvd.init(), so it runs
    before Horovod's own atexit shutdown, which then has nothing left to do."""
    if not _EXIT_BOUND:
        atexit.register(_shutdown_horovod)
    _EXIT_BOUND.update(rank=rank, seconds=bound_s(timeout_s))


def _shutdown_horovod() -> None:
    import horovod.tensorflow as hvd
    bounded("Horovod shutdown at exit", _EXIT_BOUND["seconds"], _EXIT_BOUND["rank"], hvd.shutdown)
