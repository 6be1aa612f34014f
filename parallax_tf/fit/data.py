"""fit's input as global batches: NumPy arrays (or dicts of them) cut into `batch_size` rows in
a seeded per-epoch order, or a tf.data.Dataset whose elements are the global batches.

A batch is {feed name: the whole global batch's array}: the model's input names, each output's
target and, with sample or class weights, each output's weights. Every rank reads every global
batch and feeds its own slice (fit's input_fn)."""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import numpy as np

from parallax_tf.errors import ConfigError
from parallax_tf.fit.graph import target_name, weight_feed_name
from parallax_tf.fit.spec import eagerly


def named_arrays(value, names: List[str], what: str) -> Dict[str, np.ndarray]:
    """x or y (an array, a list in the model's order, or a dict by name) as arrays by name."""
    if isinstance(value, dict):
        missing = [n for n in names if n not in value]
        if missing:
            raise ConfigError(f"fit's {what} has no array for {missing}; its keys are {sorted(value)}")
        return {n: np.asarray(value[n]) for n in names}
    if isinstance(value, (list, tuple)) and len(names) > 1:
        if len(value) != len(names):
            raise ConfigError(f"fit's {what} has {len(value)} arrays for the model's {len(names)}: {names}")
        return dict(zip(names, map(np.asarray, value)))
    return {names[0]: np.asarray(value)}


def as_batch(spec, x, y, sample_weight=None, class_weight=None) -> Dict[str, np.ndarray]:
    """One global batch (or all rows) as feeds by name."""
    if y is None:
        raise ConfigError("ptf.fit needs targets: give y, or a dataset of (x, y) batches")
    batch = dict(named_arrays(x, spec.input_names, "x"))
    batch.update({target_name(n): a for n, a in named_arrays(y, spec.output_names, "y").items()})
    if sample_weight is not None:
        batch.update({weight_feed_name(n): np.asarray(a, np.float32)
                      for n, a in named_arrays(sample_weight, spec.output_names, "sample_weight").items()})
    rows = {len(a) for a in batch.values()}
    if len(rows) > 1:
        raise ConfigError(f"fit's arrays disagree on their number of rows: "
                          f"{ {k: len(a) for k, a in batch.items()} }")
    return with_class_weights(spec, batch, class_weight) if class_weight else batch


def with_class_weights(spec, batch: Dict[str, np.ndarray], class_weight: dict) -> Dict[str, np.ndarray]:
    """Keras' class_weight: each row's weight is its class's (times its sample weight)."""
    if len(spec.output_names) > 1:
        raise ConfigError("fit's class_weight is only for a model with a single output, as in Keras")
    if sorted(class_weight) != list(range(len(class_weight))):
        raise ConfigError(f"fit's class_weight needs the keys 0 to {len(class_weight) - 1}; got {sorted(class_weight)}")
    name = spec.output_names[0]
    y = batch[target_name(name)]
    classes = np.argmax(y, -1) if y.ndim >= 2 and y.shape[-1] > 1 else \
        np.round(y.reshape(len(y), *y.shape[1:-1]) if y.ndim >= 2 else y).astype(np.int64)
    found = np.array([class_weight[c] for c in range(len(class_weight))], np.float32)[classes]
    given = batch.get(weight_feed_name(name))
    if given is not None:
        found = given.reshape(given.shape + (1,) * (found.ndim - given.ndim)) * found
    return {**batch, weight_feed_name(name): found}


def keras_arguments(spec, batch: Dict[str, np.ndarray]) -> dict:
    """x, y and sample_weight for a Keras call (evaluate) from feeds by name."""
    def pick(names, key):
        found = {n: batch[key(n)] for n in names if key(n) in batch}
        return None if not found else (next(iter(found.values())) if len(names) == 1 else found)
    return {"x": pick(spec.input_names, lambda n: n), "y": pick(spec.output_names, target_name),
            "sample_weight": pick(spec.output_names, weight_feed_name)}


def split_off_validation(batch: Dict[str, np.ndarray], fraction: float):
    """Keras' validation_split: the last `fraction` of the rows (before any shuffle) validate."""
    rows = len(next(iter(batch.values())))
    at = int(math.floor(rows * (1.0 - fraction)))
    if not 0 < fraction < 1 or at in (0, rows):
        raise ConfigError(f"fit's validation_split={fraction} leaves no rows to train or to validate "
                          f"({rows} rows); give a fraction between 0 and 1")
    return {k: a[:at] for k, a in batch.items()}, {k: a[at:] for k, a in batch.items()}


class ArrayBatches:
    """Global batches of NumPy arrays: batch b of epoch e is rows [b*size, (b+1)*size) of that
    epoch's order (a permutation seeded by seed + epoch when shuffling)."""

    def __init__(self, batch: Dict[str, np.ndarray], batch_size: int, shuffle: bool, seed: int):
        self.arrays, self.batch_size, self.shuffle, self.seed = batch, batch_size, shuffle, seed
        self.rows = len(next(iter(batch.values())))
        self.per_epoch = math.ceil(self.rows / batch_size)
        self._orders: Dict[int, np.ndarray] = {}

    def first(self) -> Dict[str, np.ndarray]:
        return {k: a[:1] for k, a in self.arrays.items()}

    def rows_of(self, step: int) -> int:
        return len(self._rows(step))

    def batch(self, step: int) -> Dict[str, np.ndarray]:
        chosen = self._rows(step)
        return {k: a[chosen] for k, a in self.arrays.items()}

    def _rows(self, step: int) -> np.ndarray:
        epoch, index = divmod(step, self.per_epoch)
        if epoch not in self._orders:
            self._orders = {epoch: np.random.RandomState(self.seed + epoch).permutation(self.rows)
                            if self.shuffle else np.arange(self.rows)}
        return self._orders[epoch][index * self.batch_size:(index + 1) * self.batch_size]


class DatasetBatches:
    """Global batches from a tf.data.Dataset of (x, y[, sample_weight]) batches, read eagerly
    in order: each epoch reads the dataset afresh, or, with steps_per_epoch, one reading runs
    on across epochs (Keras' two behaviours). Every rank reads the same order, so the dataset
    must not shuffle unseeded."""

    def __init__(self, spec, dataset, steps_per_epoch: Optional[int], class_weight=None):
        import tensorflow as tf
        self.spec, self.dataset, self.class_weight = spec, dataset, class_weight
        self.runs_on = steps_per_epoch is not None
        if self.runs_on:
            self.per_epoch = steps_per_epoch
        else:
            count = int(dataset.cardinality())
            if count == tf.data.INFINITE_CARDINALITY:
                raise ConfigError("fit's dataset is infinite: give steps_per_epoch")
            self.per_epoch = count if count >= 0 else sum(1 for _ in dataset)    # unknown: count it once
        if self.per_epoch < 1:
            raise ConfigError("fit's dataset holds no batch")
        self._iterator, self._next, self._rows = None, None, {}

    def first(self) -> Dict[str, np.ndarray]:
        return self._convert(next(iter(self.dataset)))

    def rows_of(self, step: int) -> int:
        if step not in self._rows:
            self.batch(step)
        return self._rows[step]

    def batch(self, step: int) -> Dict[str, np.ndarray]:
        with eagerly():
            return self._batch(step)

    def _batch(self, step: int) -> Dict[str, np.ndarray]:
        new_epoch = not self.runs_on and step % self.per_epoch == 0
        if step != self._next or new_epoch:      # the first read, a new epoch, or a resume: read up to `step`
            begin = 0 if self.runs_on else step - step % self.per_epoch
            self._iterator, self._next = iter(self.dataset), begin
            while self._next < step:
                self._take(self._next)
        return self._take(step)

    def _take(self, step: int) -> Dict[str, np.ndarray]:
        try:
            element = next(self._iterator)
        except StopIteration:
            raise ConfigError(f"fit's dataset ran out at step {step + 1}: repeat it (dataset.repeat()) or give "
                              "fewer steps_per_epoch") from None
        batch = self._convert(element)
        self._next = step + 1
        self._rows[step] = len(next(iter(batch.values())))
        return batch

    def _convert(self, element) -> Dict[str, np.ndarray]:
        import tensorflow as tf
        element = tf.nest.map_structure(np.asarray, element)
        parts = tuple(element) if isinstance(element, (tuple, list)) else (element,)
        if not 2 <= len(parts) <= 3:
            raise ConfigError("fit's dataset must yield (x, y) or (x, y, sample_weight) batches")
        return as_batch(self.spec, parts[0], parts[1], parts[2] if len(parts) == 3 else None, self.class_weight)
