"""TensorFlow's and Keras' initializers as per-id row laws.

A dynamic table cannot call an initializer on a [vocabulary, dim] shape: a row is made when its
id first appears, on whichever rank meets it, and must come out the same everywhere. So a TF or
Keras initializer (TF2's `tf.*_initializer`, tf.compat.v1's, tf_keras' and Keras 3's classes)
is read for its law and parameters, and the table draws that law from hashes of (seed, id,
column) (ids.unit_uniform). The values differ from the initializer's own draws; the distribution
is the same. Fan-based laws (Glorot, He, LeCun: VarianceScaling) take fan = dim for every mode,
the one size a row has. An integer seed given to the initializer becomes the table's seed."""
from __future__ import annotations

import math
import numbers
from typing import Optional

import numpy as np
import tensorflow as tf

from parallax_tf.dynamic import ids as id_lib
from parallax_tf.errors import ModelError

_LIBRARIES = ("tensorflow", "tf_keras", "keras")
# std of a standard normal truncated at +-2: TF and Keras divide VarianceScaling's stddev by it
_TRUNCATED_STD = 0.87962566103423978
_TRUNCATED_AT = 2.0

ACCEPTED = ("None, a number, a parallax_tf.dynamic initializer (uniform(scale), normal(stddev), constant(value)) or "
            "a TensorFlow/Keras initializer: zeros, ones, constant (a scalar), random uniform, random normal, "
            "truncated normal, or variance scaling (Glorot, He, LeCun; fan = dim)")


class uniform_range(id_lib.RowInitializer):  # noqa: N801  (reads as the ids module's laws do)
    """Uniform in [minval, maxval)."""

    def __init__(self, minval: float, maxval: float, seed: Optional[int] = None):
        self.minval, self.maxval, self.seed = float(minval), float(maxval), seed

    def rows(self, ids, dim, seed, dtype, standard_ops=False):
        u = id_lib.unit_uniform(ids, dim, seed, standard_ops)
        return tf.cast(self.minval + (self.maxval - self.minval) * u, dtype)

    def describe(self):
        return f"uniform[{self.minval:g}, {self.maxval:g})"

    def compiled_law(self, dim, seed):
        return "range", self.minval, self.maxval - self.minval, id_lib.signed_salt(seed)


class gaussian(id_lib.RowInitializer):  # noqa: N801
    """Normal(mean, stddev), by Box-Muller over two hashed uniforms; with `truncated`, drawn
    within 2 stddev of the mean as TF's truncated normal (by the inverse of the normal's CDF over
    the uniform between the two cut points: the same law as drawing again beyond them)."""

    def __init__(self, mean: float, stddev: float, truncated: bool, seed: Optional[int] = None):
        self.mean, self.stddev, self.truncated, self.seed = float(mean), float(stddev), truncated, seed

    def rows(self, ids, dim, seed, dtype, standard_ops=False):
        u1 = id_lib.unit_uniform(ids, dim, seed, standard_ops)
        if self.truncated:
            low = 0.5 * math.erfc(_TRUNCATED_AT / math.sqrt(2.0))     # the normal's CDF at -2
            z = tf.math.ndtri(low + (1.0 - 2.0 * low) * u1)
        else:
            u2 = id_lib.unit_uniform(ids, dim, id_lib.mix_int(seed + 1), standard_ops)
            z = tf.sqrt(-2.0 * tf.math.log1p(-u1)) * tf.cos(2.0 * math.pi * u2)
        return tf.cast(self.mean + self.stddev * z, dtype)

    def describe(self):
        return f"{'truncated ' if self.truncated else ''}normal(mean {self.mean:g}, stddev {self.stddev:g})"


def row_law(value, dim: int) -> Optional[id_lib.RowInitializer]:
    """The row law of a TF or Keras initializer (an instance, or a class taking no arguments);
    None when `value` is none of those this module knows."""
    kind = _known_kind(value if isinstance(value, type) else type(value))
    if kind is None:
        return None
    if isinstance(value, type):
        value = value()
    seed = _seed_of(value)
    if kind == "Zeros":
        return id_lib.constant(0.0)
    if kind == "Ones":
        return id_lib.constant(1.0)
    if kind == "Constant":
        if np.ndim(value.value) != 0:
            raise ModelError(f"DynamicEmbedding(initializer={_name(value)}(value={value.value!r})): a table takes "
                             "a scalar constant (every element of every row), not an array")
        return id_lib.constant(_number(value.value))
    if kind == "RandomUniform":        # tf.compat.v1's maxval None means 1 for floats
        return uniform_range(_number(value.minval), 1.0 if value.maxval is None else _number(value.maxval), seed)
    if kind in ("RandomNormal", "TruncatedNormal"):
        return gaussian(_number(value.mean), _number(value.stddev), kind == "TruncatedNormal", seed)
    return _variance_scaling(value, dim, seed)


def _variance_scaling(value, dim: int, seed: Optional[int]) -> id_lib.RowInitializer:
    variance = _number(value.scale) / dim
    if value.distribution == "uniform":
        limit = math.sqrt(3.0 * variance)
        return uniform_range(-limit, limit, seed)
    if value.distribution == "untruncated_normal":
        return gaussian(0.0, math.sqrt(variance), False, seed)
    # "truncated_normal", and "normal": TF's older name for it
    return gaussian(0.0, math.sqrt(variance) / _TRUNCATED_STD, True, seed)


_KINDS = ("Zeros", "Ones", "Constant", "RandomUniform", "RandomNormal", "TruncatedNormal", "VarianceScaling")


def _known_kind(cls: type) -> Optional[str]:
    """The first class of `cls`'s bases that is one of the libraries' initializer kinds above."""
    for base in cls.__mro__:
        if base.__name__ in _KINDS and base.__module__.split(".")[0] in _LIBRARIES:
            return base.__name__
    return None


def _seed_of(initializer) -> Optional[int]:
    """The seed the user gave (Keras 3 draws one of its own when none is given: get_config says
    which it was given)."""
    try:
        seed = initializer.get_config().get("seed")
    except (AttributeError, NotImplementedError):
        seed = getattr(initializer, "seed", None)
    if seed is None or isinstance(seed, numbers.Integral):
        return None if seed is None else int(seed)
    raise ModelError(f"DynamicEmbedding(initializer={_name(initializer)}(seed={seed!r})): give the initializer an "
                     "integer seed (or none, or DynamicEmbedding(seed=...)): a table's rows are drawn from an integer")


def _number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ModelError(f"DynamicEmbedding(initializer=...): its parameter {value!r} is not a number; a table's "
                         "initializer takes Python numbers") from None


def _name(initializer) -> str:
    cls = initializer if isinstance(initializer, type) else type(initializer)
    return f"{cls.__module__.split('.')[0]}.{cls.__name__}"


def describe_refused(value) -> str:
    """How a refused initializer reads in a message: a library's class by its name, not its repr."""
    cls = value if isinstance(value, type) else type(value)
    return _name(value) if cls.__module__.split(".")[0] in _LIBRARIES else repr(value)
