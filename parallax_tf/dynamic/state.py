"""A dynamic table's contents as whole arrays under single-device keys, for checkpoints and
results, however many shards hold it:

    <table>/ids, <table>/values       live rows, ascending by id ([n], [n, dim])
    <table>/<slot>                     the optimizer's slot per live row ([n, dim])
    <table>/seen_ids, <table>/counts, <table>/last_seen
                                       every id the table tracks, live or waiting for admission
    <table>/clock                      [boundaries so far, rows admitted, rows evicted]

`tf.train.load_variable(checkpoint, "<table>/values")` reads them in plain TF."""
from __future__ import annotations

from typing import Dict, List

import numpy as np
import tensorflow as tf

from parallax_tf.dynamic import compiled
from parallax_tf.dynamic import ids as id_lib
from parallax_tf.dynamic.store import CLOCK_COLUMNS

ROW_GROUP = ("ids", "values")              # aligned with the live rows (slots too)
SEEN_GROUP = ("seen_ids", "counts", "last_seen")


class DynamicState:
    """Reads (every rank: each shard's export) and loads every dynamic table of the rank's graph:
    rank 0 the servers' shards, every rank its own copy of a table replicated on the ranks
    (`load(..., copies=True)`). Built while the graph is open."""

    def __init__(self, tables: List):
        self.tables = tables
        self._exports = {t.name: [shard.export() for shard in t.shards] for t in tables}
        self._feeds: Dict[str, Dict[str, tf.Tensor]] = {}    # table -> its load's placeholders by array name
        self._loads = [self._build_whole_load(table) if all(isinstance(shard, compiled.CompiledShard)
                                                            for shard in table.shards) else self._build_load(table)
                       for table in tables]

    def keys(self) -> List[str]:
        return [key for table in self.tables for key in self._table_keys(table)]

    @property
    def copy_keys(self) -> List[str]:
        """The keys of the tables replicated on the ranks."""
        return [key for table in self.tables if table.replicated for key in self._table_keys(table)]

    @staticmethod
    def _table_keys(table) -> List[str]:
        slots = sorted(table.shards[0].slots)
        return [f"{table.name}/{k}" for k in (*ROW_GROUP, *slots, *SEEN_GROUP, "clock")]

    def read(self, sess, keys=None) -> Dict[str, np.ndarray]:
        tables = [t for t in self.tables if keys is None or set(self._table_keys(t)) & set(keys)]
        raw = sess.run({t.name: self._exports[t.name] for t in tables})
        out = {}
        for table in tables:
            shards = [shard.unpack(fetched) for shard, fetched in zip(table.shards, raw[table.name])]
            rows = {k: np.concatenate([s[k] for s in shards]) for k in shards[0] if k != "clock"}
            order = np.argsort(rows["ids"], kind="stable")
            seen = np.argsort(rows["seen_ids"], kind="stable")
            for key, value in rows.items():
                out[f"{table.name}/{key}"] = value[seen] if key in SEEN_GROUP else value[order]
            clocks = np.stack([s["clock"] for s in shards])
            out[f"{table.name}/clock"] = np.array([clocks[0, 0], clocks[:, 1].sum(), clocks[:, 2].sum()], np.int64)
        if keys is not None:
            out = {k: v for k, v in out.items() if k in keys}
        return out

    def load(self, sess, values: Dict[str, np.ndarray], copies: bool = False) -> None:
        """Replaces the contents of every table on the servers (`copies`: of this rank's copy of
        every replicated table) with `values` (its keys; a table without them is emptied)."""
        feeds, loads = {}, []
        for table, load in zip(self.tables, self._loads):
            if table.replicated != copies:
                continue
            loads.append(load)
            given = {}
            for key in self._table_keys(table):
                name = key[len(table.name) + 1:]
                given[name] = np.asarray(values[key]) if key in values else _empty(name, table)
            given["live"] = np.isin(given["seen_ids"], given["ids"]).astype(np.int64)
            placeholders = self._feeds[table.name]
            if "slot_values" in placeholders:        # the compiled shards' import, slots stacked in their order
                slots = list(table.shards[0].slots)
                given["slot_values"] = np.stack([given[s] for s in slots]) if slots else \
                    np.zeros([0, len(given["ids"]), table.dim], table.options.dtype.as_numpy_dtype)
            feeds.update({placeholder: given[name] for name, placeholder in placeholders.items()})
        if loads:
            sess.run(loads, feeds)

    def _placeholders(self, table, names) -> Dict[str, tf.Tensor]:
        """The load's placeholders of `table`'s whole arrays."""
        dtype, dim = table.options.dtype, table.dim
        made = {}
        for name in names:
            if name == "clock":
                shape, kind = [CLOCK_COLUMNS], tf.int64
            elif name in ("ids", "live", *SEEN_GROUP):
                shape, kind = [None], tf.int64
            elif name == "slot_values":
                shape, kind = [None, None, dim], dtype
            else:
                shape, kind = [None, dim], dtype
            made[name] = tf.compat.v1.placeholder(kind, shape, name=f"parallax_load_{name}")
        self._feeds[table.name] = made
        return made

    def _build_whole_load(self, table) -> tf.Operation:
        """Compiled shards: each takes its ids from the whole arrays itself, one op a shard."""
        whole = self._placeholders(table, [*ROW_GROUP, "slot_values", *SEEN_GROUP, "live", "clock"])
        count = len(table.shards)
        return tf.group(*[shard.load_whole(whole, index, count) for index, shard in enumerate(table.shards)])

    def _build_load(self, table) -> tf.Operation:
        whole = self._placeholders(table, [key[len(table.name) + 1:] for key in self._table_keys(table)] + ["live"])
        count = len(table.shards)
        by_row = tf.dynamic_partition(tf.range(tf.size(whole["ids"])), id_lib.owner(whole["ids"], count), count)
        by_seen = tf.dynamic_partition(tf.range(tf.size(whole["seen_ids"])),
                                       id_lib.owner(whole["seen_ids"], count), count)
        loads = []
        for index, shard in enumerate(table.shards):
            parts = {name: tf.gather(value, by_seen[index] if name in SEEN_GROUP + ("live",) else by_row[index])
                     for name, value in whole.items() if name != "clock"}
            # every shard counts the same boundaries; the admitted and evicted totals stay on shard 0
            clock = whole["clock"] * (tf.constant([1, 1, 1], tf.int64) if index == 0 else
                                      tf.constant([1, 0, 0], tf.int64))
            loads.append(shard.load(dict(parts, clock=clock)))
        return tf.group(*loads)


def _empty(name: str, table) -> np.ndarray:
    if name == "clock":
        return np.zeros([CLOCK_COLUMNS], np.int64)
    if name in ("ids", *SEEN_GROUP):
        return np.zeros([0], np.int64)
    return np.zeros([0, table.dim], table.options.dtype.as_numpy_dtype)
