"""input_fn's batch as a session feed: {placeholder name: value} checked against what the graph needs."""
from __future__ import annotations

from typing import List

import numpy as np
import tensorflow as tf

from parallax_tf.errors import InputError
from parallax_tf.model import RunContext


def make_feeds(input_fn, ctx: RunContext, placeholders: List[str], graph) -> dict:
    """input_fn(ctx) -> {placeholder name: value}; checks it covers every needed placeholder."""
    if input_fn is None:
        if placeholders:
            raise InputError(f"the loss needs placeholders {placeholders} fed but no input_fn was given; "
                             "pass input_fn(ctx) returning {name: batch}")
        return {}
    batch = input_fn(ctx)
    if not isinstance(batch, dict):
        raise InputError(f"input_fn returned {type(batch).__name__}; return a dict {{placeholder name: batch}}")
    missing = [p for p in placeholders if p not in batch and not _sparse_part_given(p, batch)]
    if missing:
        raise InputError(f"input_fn did not provide placeholder(s) {missing}; it returned keys "
                         f"{sorted(batch)}. Add them to the dict input_fn returns")
    feeds = {}
    for key, value in _split_sparse(batch).items():
        try:
            feeds[graph.get_tensor_by_name(key if ":" in key else key + ":0")] = value
        except (KeyError, ValueError):
            raise InputError(f"input_fn returned key {key!r} but the graph has no placeholder of that name; "
                             f"placeholders the loss needs: {placeholders}") from None
    return feeds


_SPARSE_PARTS = ("indices", "values", "shape")


def _sparse_part_given(placeholder: str, batch: dict) -> bool:
    """A sparse_placeholder's component ("tags/indices") fed as one sparse value under "tags"."""
    base, _, part = placeholder.rpartition("/")
    return part in _SPARSE_PARTS and _is_sparse(batch.get(base))


def _is_sparse(value) -> bool:
    return isinstance(value, (tf.compat.v1.SparseTensorValue, tf.SparseTensor))


def _split_sparse(batch: dict) -> dict:
    """{"tags": SparseTensorValue or SparseTensor} -> the three placeholders of
    sparse_placeholder(name="tags"), as a session feed would split it."""
    out = {}
    for key, value in batch.items():
        if not _is_sparse(value):
            out[key] = value
            continue
        parts = (value.indices, value.values, value.dense_shape)
        arrays = [p if isinstance(p, np.ndarray) else tf.get_static_value(p) for p in parts]
        if any(a is None for a in arrays):
            raise InputError(f"input_fn returned {key!r} as a tf.SparseTensor of graph tensors; give its indices, "
                             "values and dense_shape as numpy arrays (tf.compat.v1.SparseTensorValue)")
        for part, array in zip(_SPARSE_PARTS, arrays):
            out[f"{key}/{part}"] = np.asarray(array)
    return out


def batch_size(feeds) -> int:
    """Examples in a feed dict: the first dimension of its first batched value (of a sparse
    placeholder's dense shape, not of its indices or values)."""
    names = {getattr(t, "name", ""): value for t, value in feeds.items()}
    sparse = {name[:-len("/shape:0")] for name in names if name.endswith("/shape:0")
              and f"{name[:-len('/shape:0')]}/indices:0" in names}
    for name, value in names.items():
        base, _, part = name.rpartition("/")
        if base in sparse and part in ("indices:0", "values:0"):
            continue
        if base in sparse and part == "shape:0":
            return int(np.asarray(value)[0])
        shape = np.shape(value)
        if shape:
            return int(shape[0])
    return 0
