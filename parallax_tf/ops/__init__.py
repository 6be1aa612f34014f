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
OP_PREFIX = "Parallax"      # every op type the library registers begins with it (CPU kernels only)


def is_compiled(op_type: str) -> bool:
    return op_type.startswith(OP_PREFIX)


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
        tf.no_gradient("ParallaxRoundSelection")
        tf.no_gradient("ParallaxFlatScatterUpdate")
        tf.no_gradient("ParallaxStaleApply")
        tf.no_gradient("ParallaxVersionedRead")
        tf.no_gradient("ParallaxIdUniform")
        tf.no_gradient("ParallaxIdOwner")
        for name in ("ParallaxInputStash", "ParallaxStashPut", "ParallaxStashTake", "ParallaxStashSize",
                     "ParallaxStashBatches", "ParallaxKvShard", "ParallaxKvRead", "ParallaxKvBoundary",
                     "ParallaxKvExport", "ParallaxKvImport", "ParallaxKvRemove", "ParallaxKvCounters",
                     "ParallaxKvTracked", "ParallaxKvReadMany", "ParallaxKvPush", "ParallaxKvBoundaryMany",
                     "ParallaxKvCountersMany"):
            tf.no_gradient(name)
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


def round_selection(core, n: int, seed, round_index, explore_size: int):
    """A round's selected coordinates: the core set and explore_indices' draw for it, merged
    ascending (int32, len(core) + explore_size), in O(len(core) + explore_size + n / 64)."""
    return load().parallax_round_selection(core=core, seed=tf.cast(seed, tf.int64),
                                           round=tf.cast(round_index, tf.int64), n=n, explore_size=explore_size)


def flat_scatter_update(variable, indices, updates) -> tf.Operation:
    """variable.flat[indices[i]] = updates[i] (int32 indices into the flattened variable, any
    shape), under the variable's lock."""
    return load().parallax_flat_scatter_update(resource=_handle(variable), indices=indices, updates=updates)


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


def input_stash(dtypes, capacity: int, stage: int, shared_name: str):
    """The input stash of DSP pipeline stage `stage` (a resource handle): a FIFO of (batch, the
    stage's input tensors of types `dtypes`) holding at most `capacity` batches in flight. Graphs
    that name the same `shared_name` on one device share it."""
    return load().parallax_input_stash(dtypes=[tf.as_dtype(d).base_dtype for d in dtypes], capacity=capacity,
                                       stage=stage, shared_name=shared_name)


def stash_put(handle, batch, values):
    """An op storing `values` (the stage input of `batch`); fails if the stash is full or `batch`
    is not above every batch stored before."""
    values = [tf.convert_to_tensor(v) for v in values]
    return load().parallax_stash_put(handle=handle, batch=tf.cast(batch, tf.int64), values=values)


def stash_take(handle, batch, like):
    """The values stored for `batch`, removed from the stash; fails (and removes nothing) unless
    the oldest stored entry is of `batch`. `like`: the tensors that were put, for dtypes and shapes."""
    like = [tf.convert_to_tensor(t) for t in like]
    values = load().parallax_stash_take(handle=handle, batch=tf.cast(batch, tf.int64),
                                        dtypes=[t.dtype.base_dtype for t in like])
    for value, t in zip(values, like):
        value.set_shape(t.shape)
    return values


def stash_size(handle):
    """How many batches the stash holds (int64 scalar)."""
    return load().parallax_stash_size(handle=handle)


def stash_batches(handle):
    """The batches the stash holds, oldest first (int64 vector): empty once the pipeline drained."""
    return load().parallax_stash_batches(handle=handle)


def id_uniform(ids, dim: int, salt: int):
    """[len(ids), dim] doubles in [0, 1), each a hash of (salt, id, column): see
    parallax_tf/dynamic/ids.py, whose standard-op form it equals."""
    return load().parallax_id_uniform(ids=ids, dim=dim, salt=salt)


def id_owner(ids, shards: int):
    """int32: the shard of `shards` owning each id (parallax_tf/dynamic/ids.py's `owner`)."""
    return load().parallax_id_owner(ids=ids, shards=shards)


def _handle(variable):
    return variable.handle if hasattr(variable, "handle") else variable
