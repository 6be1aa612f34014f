"""One shard of a dynamic table, on one device: TensorFlow's own mutable hash tables (standard
ops, shared by every rank's graph through their shared names on that device, freed with the
run's container).

- `values`: id -> row, live ids only; one table per optimizer slot beside it;
- `meta`: id -> (occurrences, last step seen, live) for every id the shard tracks, live or
  waiting for admission;
- `clock`: 0 -> (boundaries so far, rows admitted, rows evicted).

Reads never change a table. Every change happens at the step boundary, on the shard's device,
from the step's gradients already summed over the ranks (`boundary`)."""
from __future__ import annotations

import dataclasses
import weakref
from typing import Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from parallax_tf.dynamic import ids as id_lib

META_COLUMNS = 3      # occurrences, last step seen, live
CLOCK_COLUMNS = 3     # boundaries so far, rows admitted, rows evicted


@dataclasses.dataclass
class TableOptions:
    dim: int
    dtype: tf.DType
    initializer: id_lib.RowInitializer
    seed: int
    admit_after: int = 1
    evict_after_steps: Optional[int] = None
    capacity: Optional[int] = None


_CONSTANTS: "weakref.WeakKeyDictionary[tf.Graph, dict]" = weakref.WeakKeyDictionary()


def _const(device: Optional[str], value, dtype) -> tf.Tensor:
    """One constant per (graph, device, value) however many shards and tables use it: a step
    runs every constant it reaches as an op of its own."""
    cache = _CONSTANTS.setdefault(tf.compat.v1.get_default_graph(), {})
    key = (device, repr(value), tf.as_dtype(dtype).name)
    if key not in cache:
        with tf.control_dependencies(None), tf.device(device):
            cache[key] = tf.constant(value, dtype)
    return cache[key]


def _table(shared_name: str, key_dtype, value_dtype, value_shape):
    return tf.raw_ops.MutableHashTableOfTensorsV2(
        key_dtype=key_dtype, value_dtype=value_dtype, value_shape=value_shape, shared_name=shared_name,
        use_node_name_sharing=False, name=shared_name.replace("/", "_"))


def _find(table, keys, default):
    """Rows for `keys` (vector): [len(keys)] + default's shape."""
    found = tf.raw_ops.LookupTableFindV2(table_handle=table, keys=keys, default_value=default)
    found.set_shape(tf.TensorShape([None]).concatenate(default.shape))
    return found


def _insert(table, keys, values):
    return tf.raw_ops.LookupTableInsertV2(table_handle=table, keys=keys, values=values)


def _remove(table, keys):
    return tf.raw_ops.LookupTableRemoveV2(table_handle=table, keys=keys)


def _export(table, key_dtype, value_dtype, row_shape):
    keys, values = tf.raw_ops.LookupTableExportV2(table_handle=table, Tkeys=key_dtype, Tvalues=value_dtype)
    keys.set_shape([None])
    values.set_shape([None] + list(row_shape))
    return keys, values


def _import(table, keys, values):
    return tf.raw_ops.LookupTableImportV2(table_handle=table, keys=keys, values=values)


class Shard:
    """The tables of shard `index` of table `name` on `device` (None: wherever the caller is).
    Slot tables exist once `with_slots` named them (the optimizer is known at the boundary)."""

    def __init__(self, name: str, index: int, device: Optional[str], options: TableOptions):
        self.name, self.index, self.device, self.options = name, index, device, options
        prefix = f"parallax_dynamic/{name}/shard{index}"
        self._prefix = prefix
        with tf.control_dependencies(None), tf.device(device):     # a resource, whatever the caller waits on
            self.values = _table(prefix + "/values", tf.int64, options.dtype, [options.dim])
            self.meta = _table(prefix + "/meta", tf.int64, tf.int64, [META_COLUMNS])
            self.clock = _table(prefix + "/clock", tf.int64, tf.int64, [CLOCK_COLUMNS])
        self.slots: Dict[str, tf.Tensor] = {}
        self.slot_initial: Dict[str, float] = {}

    def with_slots(self, slots: List[Tuple[str, float]]) -> None:
        with tf.control_dependencies(None), tf.device(self.device):
            for slot, initial in slots:
                if slot not in self.slots:
                    self.slots[slot] = _table(f"{self._prefix}/slot_{slot}", tf.int64, self.options.dtype,
                                              [self.options.dim])
                    self.slot_initial[slot] = initial

    # ---- reads ---------------------------------------------------------------------------------
    def read(self, ids: tf.Tensor) -> tf.Tensor:
        """[len(ids), dim]: a live id's row; an id not admitted yet reads its initial row when
        admission is on first use (admit_after 1), else zeros."""
        opts = self.options
        with tf.device(self.device):
            live = self._live(_find(self.meta, ids, self._meta_default()))
            stored = _find(self.values, ids, self._row_default())
            fresh = self.initial_rows(ids) if opts.admit_after == 1 else tf.zeros_like(stored)
            return tf.where(live, stored, fresh)

    def _meta_default(self):
        return _const(self.device, [0, -1, 0], tf.int64)

    def _row_default(self):
        return _const(self.device, [0.0] * self.options.dim, self.options.dtype)

    def _clock_key(self):
        return _const(self.device, [0], tf.int64)

    def _live(self, meta):
        """[n, 1] bool: which of the rows of `meta` are live."""
        return tf.greater(meta[:, 2:], _const(self.device, 0, tf.int64))

    def initial_rows(self, ids):
        opts = self.options
        return opts.initializer.rows(ids, opts.dim, opts.seed, opts.dtype)

    def counters(self) -> tf.Tensor:
        """int64 [4]: live rows, boundaries so far, rows admitted, rows evicted."""
        with tf.device(self.device):
            clock = _find(self.clock, self._clock_key(), _const(self.device, [0] * CLOCK_COLUMNS, tf.int64))
            rows = tf.raw_ops.LookupTableSizeV2(table_handle=self.values)
            return tf.concat([tf.reshape(rows, [1]), tf.reshape(clock, [CLOCK_COLUMNS])], 0)

    # ---- the step boundary -----------------------------------------------------------------------
    def boundary(self, ids, grads, counts, rule) -> tf.Operation:
        """The step's end for this shard: `ids` (distinct), their gradients summed over the
        ranks and their occurrences in the global batch. Live rows (and, with admission on first
        use, new ones from their initial row) take the optimizer's step; an id whose occurrences
        reach admit_after is admitted; then rows unseen for evict_after_steps steps leave."""
        opts = self.options
        self.with_slots(rule.slots)
        with tf.device(self.device):
            clock = _find(self.clock, self._clock_key(), _const(self.device, [0] * CLOCK_COLUMNS, tf.int64))[0]
            step, admitted_before, evicted_before = tf.unstack(clock)
            meta = _find(self.meta, ids, self._meta_default())
            count, _, _ = tf.unstack(meta, axis=1)
            live = self._live(meta)                       # [n, 1]
            seen = count + counts
            if opts.admit_after == 1:       # every id trains: a new one from its initial row
                admitted = tf.logical_not(live)
                writes = [self._train(ids, grads, live, rule, step)]
            else:                           # live ids train; an id reaching admit_after gets its
                admitted = tf.logical_and(tf.logical_not(live),           # initial row, no gradient
                                          tf.greater_equal(seen, opts.admit_after)[:, None])
                trained = tf.reshape(live, [-1])
                writes = [self._train(tf.boolean_mask(ids, trained), tf.boolean_mask(grads, trained), None, rule,
                                      step)]
                fresh = tf.boolean_mask(ids, tf.reshape(admitted, [-1]))
                writes.append(self._write(fresh, self.initial_rows(fresh),
                                          {s: self._slot_start(s, fresh) for s in self.slots}))
            now_live = tf.cast(tf.logical_or(live, admitted), tf.int64)
            writes.append(_insert(self.meta, ids, tf.concat([seen[:, None], tf.ones_like(now_live) * step,
                                                             now_live], 1)))
            with tf.control_dependencies(writes):
                evicted = self._evict(step)
            with tf.control_dependencies([evicted]):
                new_clock = tf.stack([step + 1, admitted_before + tf.reduce_sum(tf.cast(admitted, tf.int64)),
                                      evicted_before + evicted])
                return _insert(self.clock, self._clock_key(), new_clock[None, :])

    def _train(self, ids, grads, live, rule, step) -> tf.Operation:
        """The rule on `ids`' rows and slots: stored ones where `live` ([n, 1]; None: all are),
        else initial ones."""
        stored = _find(self.values, ids, self._row_default())
        found = {s: _find(t, ids, self._row_default()) for s, t in self.slots.items()}
        if live is None:
            rows, slots = stored, found
        else:
            rows = tf.where(live, stored, self.initial_rows(ids))
            slots = {s: tf.where(live, value, self._slot_start(s, ids)) for s, value in found.items()}
        rows, slots = rule.apply(rows, slots, grads, step)
        return self._write(ids, rows, slots)

    def _slot_start(self, slot, ids):
        """The slot's initial value for each of `ids`."""
        return tf.zeros_like(ids, self.options.dtype)[:, None] + _const(
            self.device, [self.slot_initial[slot]] * self.options.dim, self.options.dtype)

    def _write(self, ids, rows, slots) -> tf.Operation:
        return tf.group(_insert(self.values, ids, rows), *[_insert(self.slots[s], ids, v) for s, v in slots.items()])

    def _evict(self, step) -> tf.Tensor:
        """Removes rows (and waiting ids) unseen for evict_after_steps steps; returns how many
        live rows left. (Capacity spans the shards: `over_capacity`, after every shard's boundary.)"""
        opts = self.options
        if opts.evict_after_steps is None:
            return tf.constant(0, tf.int64)
        keys, meta = _export(self.meta, tf.int64, tf.int64, [META_COLUMNS])
        _, last_seen, flag = tf.unstack(meta, axis=1)
        stale = last_seen <= step - opts.evict_after_steps
        with tf.control_dependencies([self.remove(tf.boolean_mask(keys, stale))]):
            return tf.reduce_sum(tf.cast(tf.logical_and(stale, flag > 0), tf.int64))

    def tracked(self):
        """(ids, last step seen, live) of every id the shard tracks."""
        with tf.device(self.device):
            keys, meta = _export(self.meta, tf.int64, tf.int64, [META_COLUMNS])
            return keys, meta[:, 1], meta[:, 2] > 0

    def evict(self, keys, live_count) -> tf.Operation:
        """Removes `keys`, of which `live_count` had rows: those count as evicted."""
        with tf.control_dependencies([self.remove(keys)]), tf.device(self.device):
            clock = _find(self.clock, tf.zeros([1], tf.int64), tf.zeros([CLOCK_COLUMNS], tf.int64))
            return _insert(self.clock, tf.zeros([1], tf.int64), clock + tf.stack([0, 0, live_count])[None, :])

    def remove(self, keys) -> tf.Operation:
        with tf.device(self.device):
            return tf.group(_remove(self.values, keys), _remove(self.meta, keys),
                            *[_remove(t, keys) for t in self.slots.values()])

    # ---- whole contents (checkpoints, results) ----------------------------------------------------
    def export(self) -> Dict[str, tf.Tensor]:
        """Live rows (ids, values, slots aligned with them) and every tracked id's counters."""
        opts = self.options
        with tf.device(self.device):
            row_ids, values = _export(self.values, tf.int64, opts.dtype, [opts.dim])
            out = {"ids": row_ids, "values": values}
            for slot, table in self.slots.items():
                out[slot] = _find(table, row_ids, tf.zeros([opts.dim], opts.dtype))
            seen_ids, meta = _export(self.meta, tf.int64, tf.int64, [META_COLUMNS])
            out.update(seen_ids=seen_ids, counts=meta[:, 0], last_seen=meta[:, 1])
            out["clock"] = _find(self.clock, tf.zeros([1], tf.int64), tf.zeros([CLOCK_COLUMNS], tf.int64))[0]
            return out

    def unpack(self, fetched: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """export's fetched arrays by their keys (as they are)."""
        return dict(fetched)

    def load(self, parts: Dict[str, tf.Tensor]) -> tf.Operation:
        """Replaces the shard's contents with `parts` (export's keys, this shard's ids only, and
        "live": 1 for each of seen_ids that has a row; the clock as it was saved)."""
        with tf.device(self.device):
            live = parts["live"]
            ops = [_import(self.values, parts["ids"], parts["values"]),
                   _import(self.meta, parts["seen_ids"], tf.stack([parts["counts"], parts["last_seen"], live], 1)),
                   _import(self.clock, tf.zeros([1], tf.int64), parts["clock"][None, :])]
            ops += [_import(table, parts["ids"], parts[slot]) for slot, table in self.slots.items()]
            return tf.group(*ops)


def over_capacity(shards: List[Shard], capacity: int, after) -> tf.Operation:
    """Once `after` ran (every shard's boundary), removes the least recently seen rows (ties:
    lower id first) beyond `capacity` over all shards together, and as many ids waiting for
    admission beyond it, so that a table holds what it would in one process."""
    with tf.control_dependencies(after):
        tracked = [shard.tracked() for shard in shards]
    keys = tf.concat([t[0] for t in tracked], 0)
    last_seen = tf.concat([t[1] for t in tracked], 0)
    live = tf.concat([t[2] for t in tracked], 0)
    over, live_over = [], None
    for group in (live, tf.logical_not(live)):
        group_keys = tf.boolean_mask(keys, group)
        excess = tf.maximum(tf.size(group_keys) - capacity, 0)
        dropped = _least_recent(group_keys, tf.boolean_mask(last_seen, group))[:excess]
        live_over = dropped if live_over is None else live_over
        over.append(dropped)
    dropped = tf.concat(over, 0)
    ops = []
    for index, (shard, mine) in enumerate(zip(shards, _by_owner(dropped, len(shards)))):
        live_mine = tf.reduce_sum(tf.cast(tf.equal(id_lib.owner(live_over, len(shards)), index), tf.int64))
        ops.append(shard.evict(mine, live_mine))
    return tf.group(*ops)


def _by_owner(keys, count: int):
    return tf.dynamic_partition(keys, id_lib.owner(keys, count), count) if count > 1 else [keys]


def _least_recent(keys, last_seen):
    """`keys` ordered least recently seen first, ties by lower id."""
    by_id = tf.argsort(keys, stable=True)
    by_seen = tf.argsort(tf.gather(last_seen, by_id), stable=True)
    return tf.gather(tf.gather(keys, by_id), by_seen)
