"""Moving whole single-device values in and out of a distributed graph's pieces.

Used to start from the single-device initial values and to hand back whole variables; the
split/merge follows each variable's layout ("div": contiguous rows, "mod": row i on shard i % P).
"""
from __future__ import annotations

from typing import Dict, List

import numpy as np
import tensorflow as tf


def split(whole: np.ndarray, row_ranges: List[tuple], layout: str) -> List[np.ndarray]:
    if len(row_ranges) == 1:
        return [whole]
    if layout == "mod":
        return [whole[i::len(row_ranges)] for i in range(len(row_ranges))]
    return [whole[start:end] for start, end in row_ranges]


def merge(pieces: List[np.ndarray], layout: str) -> np.ndarray:
    if len(pieces) == 1:
        return pieces[0]
    if layout != "mod":
        return np.concatenate(pieces, axis=0)
    rows = sum(p.shape[0] for p in pieces)
    whole = np.empty((rows,) + pieces[0].shape[1:], pieces[0].dtype)
    for i, piece in enumerate(pieces):
        whole[i::len(pieces)] = piece
    return whole


class ValueIO:
    """Placeholders and assign ops for every piece; built while the graph is still open."""

    def __init__(self, parts: Dict[str, list], layouts: Dict[str, str]):
        self.parts, self.layouts = parts, layouts
        self._feed, self._assign, self._read = {}, {}, {}
        with tf.name_scope("parallax_values"):
            for name, pieces in parts.items():
                for part in pieces:
                    var = part.variable
                    placeholder = tf.compat.v1.placeholder(var.dtype.base_dtype, var.shape)
                    self._feed[var.name] = placeholder
                    self._assign[var.name] = var.assign(placeholder, read_value=False)
                    self._read[var.name] = var.read_value()

    def load(self, sess, values: Dict[str, np.ndarray], only=None) -> None:
        ops, feeds = [], {}
        for name, pieces in self.parts.items():
            ranges = [(p.row_start, p.row_end) for p in pieces]
            for part, value in zip(pieces, split(values[name], ranges, self.layouts.get(name, "div"))):
                var = part.variable
                if only is not None and not only(var):
                    continue
                ops.append(self._assign[var.name])
                feeds[self._feed[var.name]] = value
        if ops:
            sess.run(ops, feeds)

    def read(self, sess) -> Dict[str, np.ndarray]:
        raw = sess.run({v: t for v, t in self._read.items()})
        return {name: merge([raw[p.variable.name] for p in pieces], self.layouts.get(name, "div"))
                for name, pieces in self.parts.items()}
