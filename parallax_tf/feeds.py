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
            tensor = graph.get_tensor_by_name(key if ":" in key else key + ":0")
        except (KeyError, ValueError):
            raise InputError(f"input_fn returned key {key!r} but the graph has no placeholder of that name; "
                             f"placeholders the loss needs: {placeholders}") from None
        _check_fits(key, value, tensor, ctx)
        feeds[tensor] = value
    return feeds


_KINDS = {"b": "bool", "i": "integer", "u": "integer", "f": "float", "c": "complex", "U": "string", "S": "string",
          "O": "string"}


def _check_fits(key: str, value, tensor, ctx: RunContext) -> None:
    """The value's shape and dtype fit the placeholder, or one InputError naming both."""
    array = value if isinstance(value, np.ndarray) else np.asarray(value)
    where = f"input_fn(ctx) at rank {ctx.rank}, step {ctx.step} returned {key!r}" if ctx is not None else \
        f"input_fn returned {key!r}"
    if not tensor.shape.is_compatible_with(array.shape):
        raise InputError(f"{where} with shape {tuple(array.shape)}, but placeholder {tensor.op.name!r} takes shape "
                         f"{_shape(tensor.shape)}; return a batch of that shape")
    got, want = _KINDS.get(array.dtype.kind), _KINDS.get(np.dtype(tensor.dtype.as_numpy_dtype).kind)
    # an integer batch feeds a float placeholder exactly; a float one would be truncated into an int
    if got and want and got != want and not (got in ("integer", "bool") and want == "float"):
        raise InputError(f"{where} as {array.dtype} ({got}) values, but placeholder {tensor.op.name!r} is "
                         f"{tensor.dtype.name}; convert it (np.asarray(x, np.{tensor.dtype.as_numpy_dtype.__name__}))")


def _shape(shape) -> str:
    return "(" + ", ".join("None" if d is None else str(d) for d in shape.as_list()) + \
        ("," if shape.rank == 1 else "") + ")" if shape.rank is not None else "unknown"


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
