"""Quiet by default: TensorFlow's and Horovod's own logs only with --verbose.

TensorFlow reads TF_CPP_MIN_LOG_LEVEL once, at its first log line (its import), so the C++
side is quieted through the environment of the ranks the launcher starts (and of this process
when parallax_tf is imported before TensorFlow). The Python side (deprecation notices through
TF's logger and `warnings`) is quieted here. Errors always show."""
from __future__ import annotations

import logging
import os
import warnings

QUIET_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}


def environment(env: dict, verbose: bool) -> dict:
    """`env` for ranks: TF's C++ logs at warnings and above only, unless verbose or set."""
    if verbose:
        return env
    return {**QUIET_ENV, **env}


def apply(verbose: bool) -> None:
    if verbose:
        return
    import tensorflow as tf
    tf.get_logger().setLevel(logging.ERROR)
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
    if "--verbose" not in argv and "--verbose=true" not in argv:
        for key, value in QUIET_ENV.items():
            os.environ.setdefault(key, value)
