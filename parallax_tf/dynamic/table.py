"""`DynamicEmbedding`: an embedding over arbitrary int64 (or string) ids with no vocabulary size.

A table is declared inside model_fn like any layer. Each lookup reads the distinct ids of its
batch from the shards that own them (one shard in a single process; one per parameter-server
host under parallax_tf.run) and records what it read, so that the step can train exactly those
rows: `step` in a single process, the synchronous step's dynamic-table part under run
(rewriters/shared/dynamic_step.py)."""
from __future__ import annotations

import contextlib
import dataclasses
import numbers
import weakref
import zlib
from typing import Dict, List, Optional, Sequence

import tensorflow as tf

from parallax_tf.dynamic import compiled
from parallax_tf.dynamic import ids as id_lib
from parallax_tf.dynamic import initializers
from parallax_tf.dynamic.rules import rule_for
from parallax_tf.dynamic.served import ServedRows
from parallax_tf.dynamic.store import Shard, TableOptions, over_capacity
from parallax_tf.errors import ModelError

# per graph, its tables and every lookup of them (not graph collections: a SavedModel would try
# to write those into its MetaGraph)
_IN_GRAPH: "weakref.WeakKeyDictionary[tf.Graph, Dict[str, list]]" = weakref.WeakKeyDictionary()
COMBINERS = ("sum", "mean", "sqrtn")
_SHARD_DEVICES: List[Optional[str]] = [None]    # where the tables built now put their shards
_REPLICATED: Dict[str, str] = {}                 # ... but these: table -> the one device of its copy
_SERVING = [False]                               # tables built now serve from a checkpoint's arrays
_DEFERRED = [False]                              # their reads are left to the step (packed per server)


@contextlib.contextmanager
def sharded_over(devices: Sequence[str], deferred: bool = False, replicated: Sequence[str] = (),
                 own_device: Optional[str] = None):
    """Tables declared inside put shard k on devices[k] (the rewrite: one per PS host), except
    those named in `replicated`: one shard on `own_device`, this rank's copy of the whole table.
    With `deferred`, a lookup's reads are stand-ins of the right shape that the step replaces by
    its own reads, so no read is built twice: its rows' (Lookup.stand_in) where the table's
    shards compile, else each shard read's (ShardRead.deferred)."""
    global _SHARD_DEVICES, _REPLICATED
    before, _SHARD_DEVICES = _SHARD_DEVICES, list(devices)
    replicated_before, _REPLICATED = _REPLICATED, {name: own_device for name in replicated}
    deferred_before, _DEFERRED[0] = _DEFERRED[0], deferred
    try:
        yield
    finally:
        _SHARD_DEVICES, _REPLICATED, _DEFERRED[0] = before, replicated_before, deferred_before


@contextlib.contextmanager
def serving():
    """Tables declared inside read a checkpoint's live rows through standard ops (export)."""
    before, _SERVING[0] = _SERVING[0], True
    try:
        yield
    finally:
        _SERVING[0] = before


@dataclasses.dataclass(eq=False)
class ShardRead:
    """What one lookup asked one shard: `ids` (sent from the worker), their positions among the
    lookup's distinct ids (`where`; None: all of them, in order) and the shard's answer `rows`
    (on the shard's device). A rewrite that packs several reads into one message sets
    `ids_on_server` to the ids as the shard's device received them."""
    shard: object            # store.Shard or compiled.CompiledShard
    ids: tf.Tensor
    where: Optional[tf.Tensor]
    rows: tf.Tensor
    ids_on_server: Optional[tf.Tensor] = None
    deferred: bool = False          # `rows` stands in for the read the step builds


def _read_or_defer(shard, ids, where) -> ShardRead:
    if not _DEFERRED[0]:
        return ShardRead(shard, ids, where, shard.read(ids))
    return ShardRead(shard, ids, where, _stand_in(ids, shard.options), deferred=True)


def _stand_in(ids, options: TableOptions) -> tf.Tensor:
    """[len(ids), dim] zeros standing in for rows the step reads."""
    return tf.zeros_like(ids, options.dtype)[:, None] + tf.zeros([options.dim], options.dtype)


@dataclasses.dataclass
class Lookup:
    """One lookup's read: its distinct ids, their rows (what the gradient is taken against), how
    often each occurs in the batch, and what it asked each shard; or, for a table whose shards
    compile, the stand-in for its rows that the step replaces by one routed read of every such
    lookup (dynamic/routes.py)."""
    table: "DynamicEmbedding"
    ids: tf.Tensor
    rows: tf.Tensor
    counts: tf.Tensor
    reads: List[ShardRead] = dataclasses.field(default_factory=list)
    stand_in: Optional[tf.Tensor] = None


class DynamicEmbedding:
    """An embedding table whose rows exist for the ids seen, not for a vocabulary.

    - `initializer`: a parallax_tf.dynamic RowInitializer (`uniform`, `normal`, `constant`), a
      number, or a TF/Keras initializer (zeros, ones, constant, random uniform/normal, truncated
      normal, Glorot/He/LeCun with fan = dim: dynamic/initializers.py); None: uniform with
      variance 1/dim. A row's initial value depends on its id and the table's seed alone (`seed`,
      else the initializer's, else one from the name), so it is the same whichever rank first
      meets the id.
    - `admit_after` k: an id gets a row once it has occurred k times (k = 1: on first use). Until
      then it reads zeros and its gradient is dropped.
    - `evict_after_steps` T: a row (and an id's count) unseen for T steps is dropped.
    - `capacity` C: at most C rows; beyond it the least recently seen go first (ties: lower id).
    - `optimizer`: the tf.compat.v1.train optimizer whose rule trains the rows (None: the
      model's own). Its slots are kept per row, beside the row.
    Everything that changes the table happens at the end of a step, after the step's gradients
    are summed over every rank; lookups within a step read the table as the last step left it."""

    def __init__(self, name: str, dim: int, initializer=None, admit_after: int = 1,
                 evict_after_steps: Optional[int] = None, capacity: Optional[int] = None, optimizer=None,
                 dtype=tf.float32, seed: Optional[int] = None):
        graph = tf.compat.v1.get_default_graph()
        self.options = table_options(name, dim, initializer, admit_after, evict_after_steps, capacity, dtype, seed)
        if any(t.name == name for t in tables(graph)):
            raise ModelError(f"two dynamic tables are named {name!r}; give each DynamicEmbedding its own name")
        self.name, self.dim, self.optimizer = name, dim, optimizer
        self.served = ServedRows(name, self.options) if _SERVING[0] else None
        self.replicated = name in _REPLICATED       # every rank holds the whole table (its one shard)
        if self.replicated and not compiled.compiles(self.options):
            raise ModelError(f"dynamic table {name!r} cannot be replicated on the ranks: only a float32 table with a "
                             "uniform or constant law can, not normal; leave it on the servers "
                             "(--dynamic_tables=servers)")
        devices = [_REPLICATED[name]] if self.replicated else _SHARD_DEVICES
        self.shards = [] if self.served else [_shard(name, i, device, self.options)
                                               for i, device in enumerate(devices)]
        _registry(graph)["tables"].append(self)

    def lookup(self, ids, name: Optional[str] = None) -> tf.Tensor:
        """ids.shape + [dim] rows for an int32/int64 or string tensor of any shape."""
        with tf.name_scope(name or f"{self.name}_lookup"):
            ids = id_lib.as_int64(ids)
            rows, position = self._read(tf.reshape(ids, [-1]))
            found = tf.gather(rows, position)
            return tf.reshape(found, tf.concat([tf.shape(ids), [self.dim]], 0))

    def lookup_sparse(self, sp_ids: tf.SparseTensor, combiner: str = "mean", name: Optional[str] = None):
        """[rows of sp_ids, dim]: each row's ids combined as tf.nn.embedding_lookup_sparse does
        ("sum", "mean", "sqrtn"); a row without ids gives zeros."""
        if combiner not in COMBINERS:
            raise ModelError(f"lookup_sparse(combiner={combiner!r}): use one of {', '.join(COMBINERS)}")
        if not isinstance(sp_ids, tf.SparseTensor):
            raise ModelError(f"lookup_sparse takes a tf.SparseTensor of ids, got {type(sp_ids).__name__}")
        with tf.name_scope(name or f"{self.name}_lookup_sparse"):
            rows, position = self._read(id_lib.as_int64(sp_ids.values))
            found = tf.gather(rows, position)
            segments, num = sp_ids.indices[:, 0], sp_ids.dense_shape[0]
            total = tf.math.unsorted_segment_sum(found, segments, num)
            if combiner == "sum":
                return total
            count = tf.math.unsorted_segment_sum(tf.ones_like(segments, found.dtype), segments, num)[:, None]
            scale = count if combiner == "mean" else tf.sqrt(count)
            return tf.math.divide_no_nan(total, scale)

    def _read(self, flat_ids):
        """The distinct ids' rows, and each id's position among them; recorded as a Lookup."""
        distinct, position = tf.unique(flat_ids, out_idx=tf.int32)
        if self.served is not None:
            return self.served.read(distinct), position
        counts = tf.math.unsorted_segment_sum(tf.ones_like(position, tf.int64), position, tf.size(distinct))
        stand_in = None
        if _DEFERRED[0] and compiled.fusable(self.shards):
            stand_in = _stand_in(distinct, self.options)
            rows, reads = stand_in, []
        elif len(self.shards) == 1:
            reads = [_read_or_defer(self.shards[0], distinct, None)]
            rows = reads[0].rows
        else:
            owner = id_lib.owner(distinct, len(self.shards))
            parts = tf.dynamic_partition(distinct, owner, len(self.shards))
            where = tf.dynamic_partition(tf.range(tf.size(distinct)), owner, len(self.shards))
            reads = [_read_or_defer(shard, part, at) for shard, part, at in zip(self.shards, parts, where)]
            rows = tf.dynamic_stitch(where, [read.rows for read in reads])
        rows = tf.identity(rows, name="rows")
        _registry(tf.compat.v1.get_default_graph())["lookups"].append(Lookup(self, distinct, rows, counts, reads,
                                                                             stand_in))
        return rows, position

    def rule(self, model_optimizer=None):
        """The row rule this table trains with (its own optimizer, else the model's)."""
        optimizer = self.optimizer if self.optimizer is not None else model_optimizer
        if optimizer is None:
            raise ModelError(f"dynamic table {self.name!r} has no optimizer: the model has several (or none "
                             "that parallax_tf sees); pass DynamicEmbedding(..., optimizer=...)")
        return rule_for(optimizer)

    def end_step(self, boundaries: List[tf.Operation]) -> tf.Operation:
        """What follows every shard's boundary of a step: the capacity, over all shards."""
        if self.options.capacity is None:
            return tf.group(*boundaries)
        return over_capacity(self.shards, self.options.capacity, boundaries)

    def describe(self) -> Dict[str, object]:
        o = self.options
        return {"name": self.name, "dim": self.dim, "dtype": o.dtype.name, "initializer": o.initializer.describe(),
                "admit_after": o.admit_after, "evict_after_steps": o.evict_after_steps, "capacity": o.capacity}


def _shard(name: str, index: int, device, options: TableOptions):
    """A table's shard: the compiled hash map where it holds the rows (float32), else the
    standard-op tables (the reference, which serving reads too)."""
    if compiled.holds(options):
        return compiled.CompiledShard(name, index, device, options)
    return Shard(name, index, device, options)


def model_optimizer(applies):
    """The optimizer a table without its own trains with: the model's, when it has exactly one (a
    traced step's apply holds the one it `used`; a hand-written update has none)."""
    optimizers = {id(getattr(a.optimizer, "used", a.optimizer)): a.optimizer for a in applies
                  if getattr(a.optimizer, "used", a.optimizer) is not None}
    return next(iter(optimizers.values())) if len(optimizers) == 1 else None


def describe_tables(graph, applies) -> List[Dict[str, object]]:
    """Each table of `graph` as plain data, with the rule it trains by (one ModelError for a
    table whose optimizer has none)."""
    optimizer = model_optimizer(applies)
    rules = [table.rule(optimizer) for table in tables(graph)]
    return [dict(table.describe(), optimizer=rule.kind, slots=len(rule.slots),
                 compiles=compiled.compiles(table.options)) for table, rule in zip(tables(graph), rules)]


def id_counts(graph) -> Dict[str, tf.Tensor]:
    """Per table of `graph`, the distinct ids one step's lookups read (summed over its lookups)."""
    sizes: Dict[str, list] = {}
    for look in lookups(graph):
        sizes.setdefault(look.table.name, []).append(tf.size(look.ids))
    with graph.as_default():
        return {name: tf.add_n(found) for name, found in sizes.items()}


def _registry(graph) -> Dict[str, list]:
    return _IN_GRAPH.setdefault(graph, {"tables": [], "lookups": []})


def tables(graph=None) -> List[DynamicEmbedding]:
    return list(_registry(graph or tf.compat.v1.get_default_graph())["tables"])


def lookups(graph=None) -> List[Lookup]:
    return list(_registry(graph or tf.compat.v1.get_default_graph())["lookups"])


@dataclasses.dataclass
class StepRows:
    """One table's share of a step on this rank: distinct ids, the loss's gradient for each, how
    often each occurred, and the reads the step's end must follow."""
    table: DynamicEmbedding
    ids: tf.Tensor
    grads: tf.Tensor
    counts: tf.Tensor
    reads: List[tf.Operation]


def step_rows(loss) -> List[StepRows]:
    """Per table, this graph's lookups of it merged: the gradient of `loss` for each distinct id
    (ids whose lookups the loss does not reach have a zero gradient) and its occurrences."""
    found = lookups(loss.graph)
    grads = tf.gradients(loss, [look.rows for look in found]) if found else []
    out = []
    for table in tables(loss.graph):
        mine = [(look, g) for look, g in zip(found, grads) if look.table is table]
        if mine:
            out.append(StepRows(table, *merged(mine), [look.rows.op for look, _ in mine]))
    return out


def merged(lookups_and_grads):
    """(distinct ids, their summed gradient rows, their occurrences) over several lookups of one
    table, each given with the loss's gradient for its rows (None: the loss does not reach it)."""
    ids = tf.concat([look.ids for look, _ in lookups_and_grads], 0)
    dense = [tf.zeros_like(look.rows) if g is None else tf.convert_to_tensor(g) for look, g in lookups_and_grads]
    distinct, position = tf.unique(ids, out_idx=tf.int32)
    n = tf.size(distinct)
    return (distinct, tf.math.unsorted_segment_sum(tf.concat(dense, 0), position, n),
            tf.math.unsorted_segment_sum(tf.concat([look.counts for look, _ in lookups_and_grads], 0), position, n))


def partition(rows_ids, values: Sequence[tf.Tensor], shards: int):
    """Splits `rows_ids` and tensors aligned with them by owning shard."""
    if shards == 1:
        return [[rows_ids, *values]]
    owner = id_lib.owner(rows_ids, shards)
    split = [tf.dynamic_partition(t, owner, shards) for t in (rows_ids, *values)]
    return [list(parts) for parts in zip(*split)]


def step(loss, optimizer=None) -> tf.Operation:
    """A single process's training of every dynamic table of loss's graph by one step: each
    table's optimizer applied to the rows the step read (a train op runs it beside its own:
    `tf.group(opt.minimize(loss), ptf.dynamic.step(loss, opt))`)."""
    ends = []
    for rows in step_rows(loss):
        rule = rows.table.rule(optimizer)
        with tf.control_dependencies(rows.reads):
            boundaries = [shard.boundary(ids, grads, counts, rule) for shard, (ids, grads, counts) in zip(
                rows.table.shards, partition(rows.ids, [rows.grads, rows.counts], len(rows.table.shards)))]
        ends.append(rows.table.end_step(boundaries))
    return tf.group(*ends, name="parallax_dynamic_step")


def table_options(name: str, dim: int, initializer=None, admit_after: int = 1, evict_after_steps=None,
                  capacity=None, dtype=tf.float32, seed=None) -> TableOptions:
    """A table's options, checked (one ModelError naming what is wrong), its law and seed resolved."""
    _check(name, dim, admit_after, evict_after_steps, capacity)
    law = _initializer(initializer, dim)
    return TableOptions(dim=dim, dtype=tf.as_dtype(dtype), initializer=law, seed=_seed(name, seed, law),
                        admit_after=admit_after, evict_after_steps=evict_after_steps, capacity=capacity)


def _initializer(value, dim: int) -> id_lib.RowInitializer:
    if value is None:
        return id_lib.uniform()
    if isinstance(value, id_lib.RowInitializer):
        return value
    if isinstance(value, numbers.Real):
        return id_lib.constant(float(value))
    law = initializers.row_law(value, dim)
    if law is None:
        raise ModelError(f"DynamicEmbedding(initializer={initializers.describe_refused(value)}): pass "
                         f"{initializers.ACCEPTED}; a row's initial value must depend on its id alone")
    return law


def _seed(name: str, seed: Optional[int], law: id_lib.RowInitializer) -> int:
    """The table's seed: DynamicEmbedding's, else its initializer's, else one from its name."""
    if seed is not None and law.seed is not None and int(seed) != law.seed:
        raise ModelError(f"DynamicEmbedding({name!r}, seed={seed}) and its initializer's seed={law.seed} differ; "
                         "give the seed in one of the two places")
    for given in (seed, law.seed):
        if given is not None:
            return int(given)
    return zlib.crc32(name.encode())


def _check(name, dim, admit_after, evict_after_steps, capacity) -> None:
    if not isinstance(name, str) or not name or ":" in name:
        raise ModelError(f"DynamicEmbedding(name={name!r}): give a non-empty name without ':'")
    for what, value, least in (("dim", dim, 1), ("admit_after", admit_after, 1)):
        if not isinstance(value, numbers.Integral) or value < least:
            raise ModelError(f"DynamicEmbedding({what}={value!r}): must be an integer >= {least}")
    for what, value in (("evict_after_steps", evict_after_steps), ("capacity", capacity)):
        if value is not None and (not isinstance(value, numbers.Integral) or value < 1):
            raise ModelError(f"DynamicEmbedding({what}={value!r}): must be None or an integer >= 1")
