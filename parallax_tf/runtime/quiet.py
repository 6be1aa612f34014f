"""Quiet by default: TensorFlow's and Horovod's own logs only with --verbose.

TensorFlow reads TF_CPP_MIN_LOG_LEVEL once, at its first log line (its import), so the C++
side is quieted through the environment of the ranks the launcher starts (and of this process
when parallax_tf is imported before TensorFlow). What TF's C++ side prints while it loads,
before its log settings take effect (absl's pre-initialisation notice, oneDNN's), is held back
during the import and dropped (tensorflow_import). The Python side (deprecation notices through
TF's logger and `warnings`) is quieted here, but for TensorFlow's notices that the user's own
code calls a deprecated API, once each. Errors always show."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import warnings

from parallax_tf.runtime.rank_output import is_noise

QUIET_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}


def environment(env: dict, verbose: bool) -> dict:
    """`env` for ranks: TF's C++ logs at warnings and above only, unless verbose or set."""
    if verbose:
        return env
    return {**QUIET_ENV, **env}


class UserDeprecations(logging.Filter):
    """Of TensorFlow's Python log records below ERROR, only its deprecation notices about the
    user's own code pass ("From <their file>:<line>: ... is deprecated"), each once."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def filter(self, record) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        message = record.getMessage()
        where = re.match(r"From (.+?):\d+: ", message)
        if not where or "is deprecated" not in message or not _user_file(where.group(1)) or message in self.seen:
            return False
        self.seen.add(message)
        return True


def _user_file(path: str) -> bool:
    """Not TensorFlow's, a library's or the toolkit's own."""
    ours = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return not ("site-packages" in path or "dist-packages" in path or path.startswith(sys.base_prefix)
                or path.startswith((os.path.join(ours, "parallax_tf"), os.path.join(ours, "rewriters"))))


def apply(verbose: bool) -> None:
    if verbose:
        return
    import tensorflow as tf
    logger = tf.get_logger()
    logger.setLevel(logging.WARNING)
    if not any(isinstance(f, UserDeprecations) for f in logger.filters):
        logger.addFilter(UserDeprecations())
    try:
        from absl import logging as absl_logging
        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:
        pass
    for module in ("tensorflow", "tf_keras", "horovod", "keras"):
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=module)
        warnings.filterwarnings("ignore", category=UserWarning, module=module)


def prefer_quiet_tensorflow(argv) -> None:
    """Before TensorFlow is imported: keep its C++ info lines (oneDNN...) out unless --verbose."""
    if not verbose_in(argv):
        for key, value in QUIET_ENV.items():
            os.environ.setdefault(key, value)


@contextlib.contextmanager
def tensorflow_import(argv):
    """Around the first import of TensorFlow: this process's stderr (file descriptor 2) goes to a
    file, and what is not a start-up notice is written back afterwards, in order."""
    if verbose_in(argv) or "tensorflow" in sys.modules:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines(keepends=True)
                    if not is_noise(line.rstrip("\r\n"))]
            if kept:
                os.write(2, "".join(kept).encode())


def verbose_in(argv) -> bool:
    """Whether a command line asks for --verbose (read before absl parses it)."""
    return any(a in ("--verbose", "--verbose=true", "--verbose=1", "--verbose=True") for a in argv)
