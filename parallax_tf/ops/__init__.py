"""parallax_tf's compiled TF ops (C++ sources beside this file, built by setup.py against the
installed TensorFlow; see BUILD.md).

Every process that runs one of these ops must have loaded the library, parameter-server
processes included (here PS servers live inside the rank processes): a rewriter that uses them
calls `load()` while building, on every rank.
"""
from __future__ import annotations

import glob
import os

import tensorflow as tf

_LIBRARY = None


def load():
    """The op library, loaded once per process."""
    global _LIBRARY
    if _LIBRARY is None:
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        found = sorted(glob.glob(os.path.join(package, "_parallax_ops*.so")))
        if not found:
            raise ImportError("parallax_tf's compiled ops are not built (no parallax_tf/_parallax_ops*.so): "
                              "run `make setup`, or `pip install --no-build-isolation -e .` in the venv")
        _LIBRARY = tf.load_op_library(found[0])
        tf.no_gradient("ParallaxSignificanceSelect")
        tf.no_gradient("ParallaxExploreIndices")
    return _LIBRARY


def significance_select(weights, update, lam, seed, round_index, core_size: int, explore_size: int):
    """(core, explored), both int32 and ascending: the `core_size` coordinates of the flattened
    variable with the largest |weights| + lam * |update| (ties: lower index first), found by
    partial selection in O(n), and `explore_size` coordinates drawn uniformly without
    replacement from the others, a function of (core set, seed, round_index) only."""
    return load().parallax_significance_select(
        weights=weights, update=update, lambda_=tf.cast(lam, tf.float32), seed=tf.cast(seed, tf.int64),
        round=tf.cast(round_index, tf.int64), core_size=core_size, explore_size=explore_size)


def explore_indices(core, n: int, seed, round_index, explore_size: int):
    """The explored set significance_select draws for this core set (sorted int32 indices of a
    variable with n elements), seed and round: any rank that knows the core set draws it."""
    return load().parallax_explore_indices(core=core, seed=tf.cast(seed, tf.int64),
                                           round=tf.cast(round_index, tf.int64), n=n, explore_size=explore_size)
