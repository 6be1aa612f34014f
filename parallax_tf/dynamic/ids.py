"""Ids and per-id initial rows: everything here is a pure function of the id, so every rank (and
a restart) computes the same row for the same id without asking anyone.

String ids become int64 by FarmHash's Fingerprint64 modulo 2^63 - 1
(`tf.strings.to_hash_bucket_fast(s, 2**63 - 1)`): non-negative, stable across processes,
platforms and TensorFlow versions."""
from __future__ import annotations

import abc
import math
from typing import Optional, Tuple

import numpy as np
import tensorflow as tf

STRING_BUCKETS = 2 ** 63 - 1
_GOLDEN = 0x9E3779B97F4A7C15      # splitmix64's constants (Steele, Lea, Flood 2014)
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def as_int64(ids) -> tf.Tensor:
    """int64 ids from an int32/int64 or string tensor (strings by Fingerprint64, above)."""
    ids = tf.convert_to_tensor(ids)
    if ids.dtype == tf.string:
        return tf.strings.to_hash_bucket_fast(ids, STRING_BUCKETS)
    if ids.dtype not in (tf.int32, tf.int64):
        raise TypeError(f"dynamic table ids must be int32, int64 or string, got {ids.dtype.name}")
    return tf.cast(ids, tf.int64)


def mix(x: tf.Tensor) -> tf.Tensor:
    """splitmix64's finaliser on uint64: a bijection whose outputs look uniform."""
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(30, tf.uint64)))
    x = x * tf.constant(_MIX1, tf.uint64)
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(27, tf.uint64)))
    x = x * tf.constant(_MIX2, tf.uint64)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(31, tf.uint64)))


def owner(ids: tf.Tensor, shards: int, standard_ops: bool = False) -> tf.Tensor:
    """The shard (int32 in [0, shards)) that holds each id's row: mixed first, so ids with a
    pattern (all even, one range) still spread evenly. One compiled op; `standard_ops`:
    TensorFlow's own bitwise ops, the same owners."""
    if shards == 1:
        return tf.zeros_like(ids, tf.int32)
    if not standard_ops:
        from parallax_tf import ops
        return ops.id_owner(ids, shards)
    mixed = mix(tf.bitcast(ids, tf.uint64) + tf.constant(_GOLDEN, tf.uint64))
    return tf.cast(mixed % tf.constant(shards, tf.uint64), tf.int32)


def unit_uniform(ids: tf.Tensor, dim: int, seed: int, standard_ops: bool = False) -> tf.Tensor:
    """[len(ids), dim] float64 in [0, 1): element j of id i is a hash of (seed, i, j). One
    compiled op in training; `standard_ops`: TensorFlow's own bitwise ops (a served model), the
    same integers and so the same values."""
    salt = mix_int(seed)
    if not standard_ops:
        from parallax_tf import ops
        return ops.id_uniform(ids, dim, signed_salt(seed))
    base = mix(tf.bitcast(ids, tf.uint64) ^ tf.constant(salt, tf.uint64))
    # (a list of Python ints above 2^53 would pass through float64 on its way to a tensor)
    counters = tf.constant(np.array([(j + 1) * _GOLDEN % 2 ** 64 for j in range(dim)], np.uint64))
    bits = mix(base[:, None] + counters[None, :])
    top53 = tf.bitwise.right_shift(bits, tf.constant(11, tf.uint64))
    return tf.cast(top53, tf.float64) * (1.0 / 2 ** 53)


def signed_salt(seed: int) -> int:
    """The salt of `seed`'s uniforms as an int64 attr of the compiled ops."""
    salt = mix_int(seed)
    return salt - 2 ** 64 if salt >= 2 ** 63 else salt


def mix_int(value: int) -> int:
    """splitmix64's finaliser in Python (for seeds)."""
    mask = 2 ** 64 - 1
    x = (value + _GOLDEN) & mask
    x = ((x ^ (x >> 30)) * _MIX1) & mask
    x = ((x ^ (x >> 27)) * _MIX2) & mask
    return x ^ (x >> 31)


class RowInitializer(abc.ABC):
    """A row per id, computed from the id alone: `rows(ids, dim, seed, dtype)`. `seed`: one the
    law was given (a TF initializer's), the table's seed when the table is given none."""
    seed: Optional[int] = None

    @abc.abstractmethod
    def rows(self, ids: tf.Tensor, dim: int, seed: int, dtype, standard_ops: bool = False) -> tf.Tensor:
        """The rows of `ids` ([n] -> [n, dim]); `standard_ops`: TF's ops only (a served model)."""

    def describe(self) -> str:
        return type(self).__name__

    def compiled_law(self, dim: int, seed: int) -> Optional[Tuple[str, float, float, int]]:
        """(kind, a, b, salt) of the law as ops/id_hash.h's RowLaw computes it inside a compiled
        op, or None where only standard ops compute it."""
        return None


class uniform(RowInitializer):  # noqa: N801  (reads like TF's initializers: ptf.dynamic.uniform(0.05))
    """Uniform in [-scale, scale); scale None: sqrt(3 / dim), a variance of 1 / dim like TF's
    embedding_column default."""

    def __init__(self, scale: float = None):
        self.scale = scale

    def rows(self, ids, dim, seed, dtype, standard_ops=False):
        scale = self.scale if self.scale is not None else math.sqrt(3.0 / dim)
        return tf.cast((2.0 * unit_uniform(ids, dim, seed, standard_ops) - 1.0) * scale, dtype)

    def describe(self):
        return f"uniform({self.scale if self.scale is not None else 'sqrt(3/dim)'})"

    def compiled_law(self, dim, seed):
        return "uniform", self.scale if self.scale is not None else math.sqrt(3.0 / dim), 0.0, signed_salt(seed)


class constant(RowInitializer):  # noqa: N801
    """Every element `value` (0.0: rows start at zero)."""

    def __init__(self, value: float = 0.0):
        self.value = float(value)

    def rows(self, ids, dim, seed, dtype, standard_ops=False):
        return tf.fill(tf.stack([tf.size(ids), dim]), tf.constant(self.value, dtype))

    def describe(self):
        return f"constant({self.value})"

    def compiled_law(self, dim, seed):
        return "constant", self.value, 0.0, 0


class normal(RowInitializer):  # noqa: N801
    """Normal with `stddev` (None: 1 / sqrt(dim)), by Box-Muller over two hashed uniforms, clipped
    at 2 standard deviations (set to +-2 stddev there, where TF's truncated normal draws again:
    a TF initializer's laws are in initializers.py)."""

    def __init__(self, stddev: float = None):
        self.stddev = stddev

    def rows(self, ids, dim, seed, dtype, standard_ops=False):
        stddev = self.stddev if self.stddev is not None else 1.0 / math.sqrt(dim)
        u1 = unit_uniform(ids, dim, seed, standard_ops)
        u2 = unit_uniform(ids, dim, mix_int(seed + 1), standard_ops)
        z = tf.sqrt(-2.0 * tf.math.log1p(-u1)) * tf.cos(2.0 * math.pi * u2)
        return tf.cast(tf.clip_by_value(z, -2.0, 2.0) * stddev, dtype)

    def describe(self):
        return f"normal({self.stddev if self.stddev is not None else '1/sqrt(dim)'})"
