"""A TF2 step's input: the script's dataset, one element (a single-device batch) a step.

Every data rank reads the dataset eagerly, in order, and feeds its share of each element's
rows (np.array_split over the data ranks, so a short last batch splits unevenly), with the
share of the batch's mean it carries (rows here x data ranks / rows in the element). A resume
at step S reads the dataset afresh and skips S elements."""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf

from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.errors import ConfigError
from parallax_tf.tf2.graph import SHARE


def element_count(dataset) -> Optional[int]:
    """How many elements the dataset holds, counted once if TF does not know; None if infinite."""
    count = int(dataset.cardinality())
    if count == tf.data.INFINITE_CARDINALITY:
        return None
    if count >= 0:
        return count
    with tf_shim.eager_mode():
        return sum(1 for _ in dataset)


class StepInputs:
    """input_fn(ctx) of a TF2 step: this rank's share of the dataset's element for ctx.step."""

    def __init__(self, dataset, names: List[str], shard_reading: bool = False):
        self.dataset, self.names, self.shard_reading = dataset, names, shard_reading
        self._iterator, self._next, self._shard = None, None, None

    def __call__(self, ctx) -> Dict[str, np.ndarray]:
        if self.shard_reading:       # this rank's own elements, each whole: r, r+N, ...
            self._shard = (ctx.size, ctx.rank)
            flat = self._element(ctx.step)
            return {**dict(zip(self.names, flat)), SHARE: np.float32(1.0)}
        flat = self._element(ctx.step)
        rows = {len(a) if np.ndim(a) else None for a in flat}
        if len(rows) != 1 or None in rows:
            raise ConfigError(f"the dataset's element holds tensors of {sorted(map(str, rows))} rows; every tensor "
                              "of an element must be a batch of the same rows (batch the dataset)")
        count = rows.pop()
        mine = np.array_split(np.arange(count), ctx.size)[ctx.rank]
        if not len(mine):
            raise ConfigError(f"step {ctx.step + 1}'s batch holds {count} rows for {ctx.size} data ranks: every rank "
                              "needs at least one; batch the dataset by at least as many rows as ranks")
        feeds = {name: array[mine] for name, array in zip(self.names, flat)}
        feeds[SHARE] = np.float32(len(mine) * ctx.size / count)
        return feeds

    def _element(self, step: int) -> List[np.ndarray]:
        with tf_shim.eager_mode():
            if self._iterator is None or step != self._next:     # the first read, or a resume: from the start
                source = self.dataset.shard(*self._shard) if self._shard else self.dataset
                self._iterator, self._next = iter(source), 0
                while self._next < step:
                    self._take(self._next)
            return self._take(step)

    def _take(self, step: int) -> List[np.ndarray]:
        try:
            element = next(self._iterator)
        except StopIteration:
            raise ConfigError(f"the dataset ran out at step {step + 1}: give fewer steps, or repeat it "
                              "(dataset.repeat())") from None
        self._next = step + 1
        return [np.asarray(t) for t in _flatten(element)]


def _flatten(structure) -> list:
    """The element's tensors in the order graph.input_names names them (dict keys sorted)."""
    if isinstance(structure, dict):
        return [t for key in sorted(structure) for t in _flatten(structure[key])]
    if isinstance(structure, (tuple, list)):
        return [t for value in structure for t in _flatten(value)]
    return [structure]
