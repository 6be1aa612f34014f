"""Moving whole single-device values in and out of a distributed graph's pieces.

Every piece of training state gets the key a plain single-device `tf.compat.v1.train.Saver`
would give it: "emb" for a (possibly sharded) variable, "emb/Adagrad" for its slot,
"beta1_power" for an optimizer's non-slot variable. Values are whole: split into shards on
the way in and merged on the way out following each variable's layout ("div": contiguous
rows, "mod": row i on shard i % P, "flat": contiguous ranges of the flattened elements, "ranks":
row i on data rank i % N, each rank holding its own shard). Starting from single-device initial
values, restoring a checkpoint and handing back results all go through here.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.inspect_graph import logical_name
from parallax_tf.plan import RANKS_LAYOUT


def split(whole: np.ndarray, row_ranges: List[tuple], layout: str) -> List[np.ndarray]:
    if layout == "flat":
        flat = whole.reshape(-1)
        return [flat[start:end] for start, end in row_ranges]
    if len(row_ranges) == 1:
        return [whole]
    if layout == "mod":
        return [whole[i::len(row_ranges)] for i in range(len(row_ranges))]
    return [whole[start:end] for start, end in row_ranges]


def merge(pieces: List[np.ndarray], layout: str, shape=None) -> np.ndarray:
    if layout == "flat":
        return np.concatenate([p.reshape(-1) for p in pieces]).reshape(shape)
    if len(pieces) == 1:
        return pieces[0]
    if layout != "mod":
        return np.concatenate(pieces, axis=0)
    rows = sum(p.shape[0] for p in pieces)
    whole = np.empty((rows,) + pieces[0].shape[1:], pieces[0].dtype)
    for i, piece in enumerate(pieces):
        whole[i::len(pieces)] = piece
    return whole


@dataclasses.dataclass
class Part:
    """One TF variable of a distributed graph holding rows [row_start, row_end) of a whole value."""
    variable: object
    row_start: int
    row_end: int


@dataclasses.dataclass
class Entry:
    """One checkpoint key: one or more copies (e.g. Adam's beta powers kept by two optimizers),
    each a list of parts that together make the whole value."""
    copies: List[List[Part]]
    layout: str = "div"
    shape: Optional[List[int]] = None    # the whole value's shape (needed by layout "flat")


def collect_state(dgraph, layouts: Dict[str, Tuple[str, list]]) -> Dict[str, Entry]:
    """Every variable of a distributed graph under its single-device name: model variables
    (whole over their shards), optimizer slots (likewise), and everything else the model and its
    optimizers keep (beta powers, batch-norm statistics, EMAs, the global step). `layouts` maps
    a variable to its plan layout and shape. The graph's working copies (a strategy's local
    replicas of saved values, its scratch) are not state."""
    entries: Dict[str, Entry] = {}
    owner, covered = {}, set(dgraph.working_copies)

    def new_entry(name, parts):
        layout, shape = layouts.get(name, ("div", None))
        return Entry([parts], layout, shape)

    for name, parts in dgraph.parts.items():
        entries[name] = new_entry(name, list(parts))
        for p in parts:
            owner[p.variable.name] = (name, p)
            covered.add(p.variable.name)
    for optimizer, variables in dgraph.optimizers:
        for var in variables:
            name, part = owner[var.name]
            for slot_name in optimizer.get_slot_names():
                slot = optimizer.get_slot(var, slot_name)
                if slot is None:
                    continue
                suffix = slot.op.name[len(var.op.name) + 1:]   # "Adagrad", "Adam_1", ...
                entry = entries.setdefault(f"{name}/{suffix}", new_entry(name, []))
                entry.copies[0].append(Part(slot, part.row_start, part.row_end))
                entry.copies[0].sort(key=lambda piece: piece.row_start)
                covered.add(slot.name)
    with dgraph.graph.as_default():
        others = [v for v in tf.compat.v1.global_variables() if v.name not in covered]
    copies = sorted((dgraph.saved_as[v.name], v) for v in others if v.name in dgraph.saved_as)
    others = [v for v in others if v.name not in dgraph.saved_as]
    for var in sorted(others, key=lambda v: _offset(v)):
        rows = int(var.shape[0]) if var.shape.rank else 1
        entry = entries.setdefault(logical_name(var), Entry([[]], layouts.get(logical_name(var), ("div",))[0]))
        start = entry.copies[0][-1].row_end if entry.copies[0] else 0
        entry.copies[0].append(Part(var, start, start + rows))
    for (key, _), var in copies:       # one more place that keeps the whole value
        entry = entries.setdefault(key, Entry([]))
        whole = [Part(var, 0, int(var.shape[0]) if var.shape.rank else 1)]
        if entry.copies == [[]]:
            entry.copies = [whole]
        else:
            entry.copies.append(whole)
    return entries


def _offset(var) -> int:
    info = tf_shim.save_slice_info(var)
    return info.var_offset[0] if info is not None and info.var_offset else 0


# dtypes Horovod's allreduce sums (what StateIO's shared reads hand every rank)
_SUMMABLE = frozenset({tf.float16, tf.float32, tf.float64, tf.int32, tf.int64})


class StateIO:
    """Placeholders and assign ops for every piece; built while the graph is still open.

    Keys in `averaged` (state each rank updates from its own batch) read as the mean over the
    ranks that keep it; keys in `owners` that are not averaged read as their first owner's value
    (the ranks that train a variable: Stanza's FC head lives on the FC nodes). Keys without
    owners are kept by every rank. Reading averaged or owned keys is collective, so every rank
    must call `read` with them at the same point. Keys of layout "ranks" are sharded over the
    ranks themselves: every rank calls `scatter` (rank 0 with the values) to load them, and
    reading them is collective too. With `read_everywhere`, `read(..., everywhere=True)` (every
    rank at the same point) reads each parameter-server piece once, on rank 0, and hands it to
    every rank through one sum (a ring: each link carries the state about twice), where every
    rank reading it would take N times the state out of each server."""

    def __init__(self, entries: Dict[str, Entry], averaged=(), num_ranks: int = 1,
                 owners: Optional[Dict[str, List[int]]] = None, rank: int = 0, dynamic=None,
                 read_everywhere: bool = False):
        self.entries = entries
        self.dynamic = dynamic          # the dynamic tables' contents (parallax_tf.dynamic.state), if any
        self._dynamic_keys = set(dynamic.keys()) if dynamic is not None else set()
        self.on_ranks = {k for k, e in entries.items() if e.layout == RANKS_LAYOUT}
        everyone = list(range(num_ranks))
        owners = {k: list(r) for k, r in (owners or {}).items() if k in entries and list(r) != everyone}
        self.averaged = {k for k in averaged if k in entries and k not in self.on_ranks} if num_ranks > 1 else set()
        self.owned = set(owners) - self.averaged if num_ranks > 1 else set()
        self._feed, self._assign, self._read = {}, {}, {}
        with tf.name_scope("parallax_values"):
            for entry in entries.values():
                for copy in entry.copies:
                    for piece in copy:
                        var = piece.variable
                        if var.name in self._feed:
                            continue
                        placeholder = tf.compat.v1.placeholder(var.dtype.base_dtype, var.shape)
                        self._feed[var.name] = placeholder
                        self._assign[var.name] = var.assign(placeholder, read_value=False)
                        self._read[var.name] = var.read_value()
            self._scatter = {}          # variable name -> (key, its _RankShard)
            for key in sorted(self.on_ranks):
                for copy in entries[key].copies:
                    for piece in copy:
                        shard = _RankShard(piece.variable, num_ranks)
                        self._scatter[piece.variable.name] = (key, shard)
                        self._read[piece.variable.name] = shard.gathered
            if self._scatter:           # which of them rank 0 has values for (slots may start as initialised)
                import horovod.tensorflow as hvd
                self._given = tf.compat.v1.placeholder(tf.int32, [len(self._scatter)])
                self._given_everywhere = hvd.broadcast(self._given, root_rank=0, name="parallax_scatter_given")
            if self.averaged or self.owned:
                import horovod.tensorflow as hvd
                for key in sorted(self.averaged | self.owned):
                    keepers = owners.get(key, everyone)
                    for piece in entries[key].copies[0]:
                        name = piece.variable.name
                        tag = name.replace(":", "_").replace("/", "_")
                        if key in self.owned:
                            self._read[name] = hvd.broadcast(self._read[name], root_rank=keepers[0],
                                                             name="parallax_from_owner_" + tag)
                        elif keepers == everyone:
                            self._read[name] = hvd.allreduce(self._read[name], op=hvd.Average,
                                                             name="parallax_mean_" + tag)
                        else:       # the mean over the ranks that keep it
                            share = (1.0 / len(keepers)) if rank in keepers else 0.0
                            self._read[name] = hvd.allreduce(
                                self._read[name] * tf.cast(share, self._read[name].dtype), op=hvd.Sum,
                                name="parallax_mean_" + tag)
            self._everywhere = self._shared_reads(rank) if read_everywhere and num_ranks > 1 else {}

    def _shared_reads(self, rank: int) -> Dict[str, tf.Tensor]:
        """Variable name -> its value on every rank, read by rank 0 alone (PS pieces that are
        read as they are: not averaged, owned or sharded over the ranks)."""
        import horovod.tensorflow as hvd
        special = {p.variable.name for k in self.averaged | self.owned | self.on_ranks
                   for copy in self.entries[k].copies for p in copy}
        shared = {}
        for entry in self.entries.values():
            for piece in entry.copies[0]:
                var = piece.variable
                if var.name in special or var.name in shared or "/job:ps" not in (var.device or "") or \
                        var.dtype.base_dtype not in _SUMMABLE:
                    continue
                source = self._read[var.name] if rank == 0 else tf.zeros(var.shape, var.dtype.base_dtype)
                shared[var.name] = hvd.allreduce(source, op=hvd.Sum,
                                                 name="parallax_everywhere_" + var.name.replace(":", "_").replace("/", "_"))
        return shared

    @property
    def shares_reads(self) -> bool:
        """Whether `read(..., everywhere=True)` shares rank 0's reads (which every rank must then call)."""
        return bool(self._everywhere)

    @property
    def keys(self) -> List[str]:
        """Every key of the training state: the variables' and the dynamic tables'."""
        return list(self.entries) + sorted(self._dynamic_keys)

    def load(self, sess, values: Dict[str, np.ndarray]) -> None:
        """Assigns whole values to every copy of the named keys (keys not given are left alone;
        dynamic tables hold exactly what `values` gives them, nothing if it has none)."""
        if self.dynamic is not None:
            self.dynamic.load(sess, {k: v for k, v in values.items() if k in self._dynamic_keys})
        ops, feeds = [], {}
        for key, value in values.items():
            if key in self.on_ranks or key in self._dynamic_keys:
                continue
            entry = self.entries[key]
            for copy in entry.copies:
                ranges = [(p.row_start, p.row_end) for p in copy]
                for piece, part_value in zip(copy, split(np.asarray(value), ranges, entry.layout)):
                    ops.append(self._assign[piece.variable.name])
                    feeds[self._feed[piece.variable.name]] = part_value
        if ops:
            sess.run(ops, feeds)

    def scatter(self, sess, values: Optional[Dict[str, np.ndarray]]) -> None:
        """Every rank: its rows of the keys held by the ranks, from rank 0's whole `values`
        (None on the other ranks), by one alltoall per piece; keys rank 0 has no value for
        (optimizer slots on a fresh start) keep what their initialisers gave. And its copy of
        every dynamic table replicated on the ranks, as rank 0's `values` give it."""
        copies = self.dynamic.copy_keys if self.dynamic is not None else []
        if copies:
            from parallax_tf.runtime import rank_objects
            given = None if values is None else {k: v for k, v in values.items() if k in copies}
            self.dynamic.load(sess, rank_objects.broadcast(given, name="parallax_table_copies"), copies=True)
        if not self._scatter:
            return
        names = sorted(self._scatter)
        given = [int(values is not None and self._scatter[name][0] in values) for name in names]
        given = sess.run(self._given_everywhere, {self._given: given})
        ops, feeds = [], {}
        for name, present in zip(names, given):
            key, shard = self._scatter[name]
            if present:
                ops.append(shard.assign)
                feeds.update(shard.feed(None if values is None else np.asarray(values[key])))
        if ops:
            sess.run(ops, feeds)

    @property
    def collective(self) -> bool:
        return bool(self.averaged or self.owned or self.on_ranks)

    def read(self, sess, keys=None, everywhere: bool = False) -> Dict[str, np.ndarray]:
        """Whole values by key. Collective when the keys include averaged state, or `everywhere`
        (parameter-server pieces read once and shared, see the class)."""
        keys = self.keys if keys is None else keys
        tables = [k for k in keys if k in self._dynamic_keys]
        found = self.dynamic.read(sess, tables) if tables else {}
        keys = [k for k in keys if k not in self._dynamic_keys]
        wanted = {p.variable.name for k in keys for p in self.entries[k].copies[0]}
        reads = {**self._read, **self._everywhere} if everywhere else self._read
        raw = {}
        for names in _batches(sorted(wanted), {name: _nbytes(reads[name]) for name in wanted}):
            raw.update(sess.run({name: reads[name] for name in names}))
        for name, (_, shard) in self._scatter.items():
            if name in raw:
                raw[name] = shard.whole(raw[name])
        found.update({k: merge([raw[p.variable.name] for p in self.entries[k].copies[0]], self.entries[k].layout,
                               self.entries[k].shape) for k in keys})
        return found


# A read of state moves at most about this much per session run (a piece larger goes alone):
# each run is a wait of its own under --timeout_s, which a slow link may stretch past that for
# the whole state at once (lm's 50 MB of weights and slots to every rank at 10 Mbit).
_READ_BATCH_BYTES = 8 << 20


def _nbytes(tensor) -> int:
    count = tensor.shape.num_elements()
    return (count or 0) * tensor.dtype.base_dtype.size


def _batches(names: List[str], sizes: Dict[str, int]) -> List[List[str]]:
    """`names` in order, in runs of at most _READ_BATCH_BYTES (every rank makes the same runs)."""
    batches, current, total = [], [], 0
    for name in names:
        if current and total + sizes[name] > _READ_BATCH_BYTES:
            batches.append(current)
            current, total = [], 0
        current.append(name)
        total += sizes[name]
    return batches + ([current] if current else [])


class _RankShard:
    """One rank's shard of a "ranks"-layout value: rank 0 scatters the whole value's rows to
    their ranks with one alltoall, and an allgather reads every rank's shard back."""

    def __init__(self, variable, num_ranks: int):
        import horovod.tensorflow as hvd
        self.num_ranks = num_ranks
        tag = variable.name.replace(":", "_").replace("/", "_")
        dtype, row_shape = variable.dtype.base_dtype, variable.shape[1:]
        self.rows = tf.compat.v1.placeholder(dtype, tf.TensorShape([None]).concatenate(row_shape))
        self.splits = tf.compat.v1.placeholder(tf.int32, [num_ranks])
        received, _ = hvd.alltoall(self.rows, splits=self.splits, name="parallax_scatter_" + tag)
        self.assign = variable.assign(received, read_value=False)
        self.gathered = hvd.allgather(variable.read_value(), name="parallax_gather_" + tag)
        self.row_shape = row_shape.as_list()

    def feed(self, whole: Optional[np.ndarray]) -> dict:
        """Rank 0 sends rows r, r+N, ... to rank r; the other ranks send nothing."""
        if whole is None:
            return {self.rows: np.zeros([0] + self.row_shape, self.rows.dtype.as_numpy_dtype),
                    self.splits: np.zeros(self.num_ranks, np.int32)}
        pieces = [whole[r::self.num_ranks] for r in range(self.num_ranks)]
        return {self.rows: np.concatenate(pieces), self.splits: np.array([len(p) for p in pieces], np.int32)}

    def whole(self, gathered: np.ndarray) -> np.ndarray:
        """The whole value from the shards gathered in rank order."""
        total, n = len(gathered), self.num_ranks
        sizes = [max(0, (total - r + n - 1) // n) for r in range(n)]
        return merge(np.split(gathered, np.cumsum(sizes)[:-1]), "mod")
