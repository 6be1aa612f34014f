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
        tf.no_gradient("ParallaxStaleApply")
        tf.no_gradient("ParallaxVersionedRead")
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


STALENESS_RULES = ("none", "inverse", "exp")
OPTIMIZERS = ("sgd", "momentum", "adagrad", "adam")


def stale_apply(version, copy_version, lr, variables, slots, powers, grads, indices, optimizer: str,
                rule: str = "inverse", gamma: float = 0.9, momentum: float = 0.0, use_nesterov: bool = False,
                beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-8):
    """Applies one push to the variables of one device, atomically: tau = version - copy_version,
    the learning rate becomes lr / max(1, tau) (rule "inverse"), lr * gamma**tau ("exp") or lr
    ("none"), `optimizer` ("sgd", "momentum", "adagrad" or "adam", TF's tf.compat.v1 update rules)
    updates every variable and its slots (momentum, adagrad: one per variable; adam: m, v per variable, `powers`
    = [beta1_power, beta2_power], advanced once), and the version advances by one. `indices[i]`
    is None for a dense gradient, else the distinct rows `grads[i]` holds. Returns (tau, the
    version after this push)."""
    sparse = [idx is not None for idx in indices]
    indices = [tf.zeros([0], tf.int64) if idx is None else tf.cast(idx, tf.int64) for idx in indices]
    dtype = variables[0].dtype.base_dtype
    return load().parallax_stale_apply(
        version=_handle(version), copy_version=tf.cast(copy_version, tf.int64), lr=tf.cast(lr, dtype),
        hyper=tf.cast(tf.stack([tf.cast(h, tf.float64) for h in (momentum, beta1, beta2, epsilon)]), dtype),
        vars=[_handle(v) for v in variables], slots=[_handle(s) for s in slots], powers=[_handle(p) for p in powers],
        grads=[tf.convert_to_tensor(g, dtype) for g in grads], indices=indices, sparse=sparse,
        optimizer=optimizer, rule=rule, gamma=gamma, use_nesterov=use_nesterov)


def versioned_read(version, variables):
    """(version, [values]) of one device's variables, read together under their locks."""
    version_value, values = load().parallax_versioned_read(
        version=_handle(version), vars=[_handle(v) for v in variables],
        dtypes=[v.dtype.base_dtype for v in variables])
    for value, var in zip(values, variables):
        value.set_shape(var.shape)
    return version_value, values


def _handle(variable):
    return variable.handle if hasattr(variable, "handle") else variable
