"""How a command-line run ends on an error.

An uncaught UserError (ConfigError, ModelError, InputError) ends the program with one line,
`parallax_tf: error: <message>`, on stderr and exit status 2; --verbose or PARALLAX_TRACEBACK=1
shows the traceback as well. A Diverged run ends the same way with status 3 (a restart would
diverge again). Any other exception keeps its traceback, and one raised inside the
toolkit's own code, not a lost peer's ClusterError, says how to report it. A rank that stops
because a peer was lost ends with its one-line message naming the peer (status 75). Only the top
level is affected (sys.excepthook): a run() called from a notebook or a test still raises."""
from __future__ import annotations

import atexit
import os
import sys

from parallax_tf.runtime.launcher import (DIVERGED_STATUS, PEER_LOST_STATUS, USER_ERROR_PREFIX as PREFIX,
                                          USER_ERROR_STATUS)
from parallax_tf.runtime.quiet import verbose_in

_PACKAGES = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), name)
                  + os.sep for name in ("parallax_tf", "rewriters"))


# Set by parallax_tf's --np launch for the ranks it starts: each must reach parallax_tf.run.
EXPECT_RUN_ENV = "PARALLAX_EXPECT_RUN"
_state = {"ran": False, "failed": False}


def ran() -> None:
    """parallax_tf.run was called in this process."""
    _state["ran"] = True


def wants_traceback() -> bool:
    return os.environ.get("PARALLAX_TRACEBACK") == "1" or verbose_in(sys.argv)


def install() -> None:
    if getattr(sys.excepthook, "_parallax", False):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        from parallax_tf.errors import Diverged, ParallaxError, UserError
        _state["failed"] = True
        if isinstance(value, UserError):
            if wants_traceback():
                previous(kind, value, tb)
            _end_with_line(PREFIX + str(value), USER_ERROR_STATUS)
        if isinstance(value, Diverged):        # the same run diverges again: no restart
            if wants_traceback():
                previous(kind, value, tb)
            _end_with_line(PREFIX + str(value), DIVERGED_STATUS, value.after_report)
        if _is_peer_lost(value) and not wants_traceback():     # its message names the peer: the rest is noise
            _end_with_line(str(value), PEER_LOST_STATUS)
        previous(kind, value, tb)
        if not isinstance(value, ParallaxError) and _raised_inside(tb):
            sys.stderr.write("parallax_tf: internal error: please report it with the traceback above and the output "
                             "of `python -m parallax_tf check`\n")

    hook._parallax = True
    sys.excepthook = hook
    atexit.register(_skip_the_final_collection)     # registered first: runs after the later handlers
    if os.environ.get(EXPECT_RUN_ENV):
        atexit.register(_check_that_run_was_called)


def _check_that_run_was_called() -> None:
    """A rank started by `--np N` whose script ends without calling parallax_tf.run trained alone,
    unsynchronised with the others (a Keras fit script, say): that ends the job as a user error."""
    if _state["ran"] or _state["failed"]:
        return
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "the script"
    keras = any(name in sys.modules for name in ("tf_keras", "keras"))
    _end_with_line(PREFIX + f"{script} ended without calling parallax_tf.run, so each of its ranks ran it alone "
                   "and nothing was synchronised. Build the model in a model_fn and call ptf.run(model_fn, ...)"
                   + (" (a Keras compile/fit script: call ptf.fit(model, x, y, batch_size=..., epochs=...) in place "
                      "of model.fit; README: Keras compile/fit)" if keras else ""),
                   USER_ERROR_STATUS)


def _skip_the_final_collection() -> None:
    """The interpreter's exit garbage-collects every object TensorFlow's import made (0.7 s on
    this rig, a rank's last second). Frozen, they are freed by reference count alone: what is
    only left in a cycle is not finalised, and the process is ending anyway. Standard streams are
    still flushed and the atexit handlers registered before this one still run."""
    import gc
    gc.disable()
    gc.freeze()


REPORT_WAIT_S = 60


def _is_peer_lost(value) -> bool:
    session = sys.modules.get("parallax_tf.runtime.session")    # not loaded: none was raised
    return session is not None and isinstance(value, session.PeerLost)


def _bounded(call) -> None:
    """Runs `call` (a Diverged's after_report) for at most REPORT_WAIT_S; its errors are moot."""
    if call is None:
        return
    import threading

    def run():
        try:
            call()
        except Exception:      # noqa: BLE001  (a peer already gone: nothing left to wait for)
            pass
    waiter = threading.Thread(target=run, daemon=True)
    waiter.start()
    waiter.join(REPORT_WAIT_S)


def _end_with_line(text: str, status: int, before_exit=None) -> None:
    """`text` as one line on stderr, then (after `before_exit`, bounded) exit past Horovod's
    atexit shutdown, which would wait for peers (a lost one among them)."""
    _flush()
    os.write(2, (" ".join(text.split("\n")) + "\n").encode())
    _bounded(before_exit)
    os._exit(status)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _raised_inside(tb) -> bool:
    """Whether the innermost frame outside installed libraries (TensorFlow, Horovod, ...) is the
    toolkit's own code, not the user's."""
    last = None
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if "site-packages" not in name and "dist-packages" not in name and not name.startswith(sys.base_prefix):
            last = name
        tb = tb.tb_next
    return last is not None and last.startswith(_PACKAGES)
