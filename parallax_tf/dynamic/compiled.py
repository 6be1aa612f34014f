"""Dynamic-table shards in parallax_tf's compiled hash map (ops/kv_*.cc).

`CompiledShard` has store.Shard's interface (a read and a boundary are one op each per shard);
the row rule is the same data (rules.RowRule) the standard-op shard reads, and store.Shard stays
the reference and what a served model reads. It holds float32 rows. `read_many`, `push`,
`boundary_many` and `counters_many` serve every compiled shard of one server in one op each
(rewriters/shared/dynamic_step.py), with the initial rows of the laws that compile (`law`)
computed inside; `push_all` stores every rank's push at once in a rank's own copy of a
replicated table (rewriters/shared/replicated_tables.py)."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf

from parallax_tf import ops as compiled_ops
from parallax_tf.dynamic.store import TableOptions
from parallax_tf.errors import ModelError

# each rule kind's hyper-parameters in the order ops/kv_shard.h's ApplyRule reads them
HYPER_ORDER = dict(sgd=["learning_rate"], momentum=["learning_rate", "momentum"], adagrad=["learning_rate"],
                   adam=["learning_rate", "beta1", "beta2", "epsilon"],
                   ftrl=["learning_rate", "l1", "l2", "beta", "l2_shrinkage"])


def holds(options: TableOptions) -> bool:
    """Whether a compiled shard can hold a table of these options."""
    return options.dtype == tf.float32


class CompiledShard:
    """Shard `index` of table `name` on `device` (None: wherever the caller is). The map keeps
    each row's slots in its entry; their names and starting values are known once `with_slots`
    named them (the optimizer is known at the boundary)."""

    def __init__(self, name: str, index: int, device: Optional[str], options: TableOptions):
        if not holds(options):
            raise ModelError(f"dynamic table {name!r}: the compiled backend holds float32 rows, not "
                             f"{options.dtype.name}")
        self.name, self.index, self.device, self.options = name, index, device, options
        self.slots: Dict[str, float] = {}
        self.shared_name = f"parallax_kv/{name}/shard{index}"
        self._ops = compiled_ops.load()
        with tf.control_dependencies(None), tf.device(device):     # a resource, whatever the caller waits on
            self.handle = self._ops.parallax_kv_shard(dim=options.dim, shared_name=self.shared_name,
                                                      name=self.shared_name.replace("/", "_"))
        self.law = options.initializer.compiled_law(options.dim, options.seed)

    def with_slots(self, slots: List[Tuple[str, float]]) -> None:
        for slot, initial in slots:
            self.slots.setdefault(slot, float(initial))
        if [s for s, _ in slots] != list(self.slots):
            raise ModelError(f"dynamic table {self.name!r} trains with two optimizers whose slots differ "
                             f"({list(self.slots)} and {[s for s, _ in slots]}); give it one optimizer")

    def initial_rows(self, ids):
        opts = self.options
        return opts.initializer.rows(ids, opts.dim, opts.seed, opts.dtype)

    # ---- reads ---------------------------------------------------------------------------------
    def read(self, ids: tf.Tensor) -> tf.Tensor:
        """[len(ids), dim]: a live id's row; an id not admitted yet reads its initial row when
        admission is on first use (admit_after 1), else zeros."""
        opts = self.options
        with tf.device(self.device):
            first_use = opts.admit_after == 1
            initial = self.initial_rows(ids) if first_use else tf.zeros([tf.size(ids), opts.dim])
            rows = self._ops.parallax_kv_read(self.handle, ids, initial, admit_on_first_use=first_use)
            rows.set_shape([None, opts.dim])
            return rows

    def counters(self) -> tf.Tensor:
        """int64 [4]: live rows, boundaries so far, rows admitted, rows evicted."""
        with tf.device(self.device):
            return self._ops.parallax_kv_counters(self.handle)

    def tracked(self):
        """(ids, last step seen, live) of every id the shard tracks."""
        with tf.device(self.device):
            return tuple(self._ops.parallax_kv_tracked(self.handle))

    # ---- the step boundary -----------------------------------------------------------------------
    def boundary(self, ids, grads, counts, rule) -> tf.Operation:
        """store.Shard.boundary in one op."""
        opts = self.options
        self.with_slots(rule.slots)
        with tf.device(self.device):
            hyper = tf.stack([rule.value(name, tf.float32) for name in HYPER_ORDER[rule.kind]])
            return self._ops.parallax_kv_boundary(
                self.handle, ids, grads, tf.cast(counts, tf.int64), self.initial_rows(ids), hyper, kind=rule.kind,
                nesterov=bool(rule.hyper.get("nesterov", False)),
                learning_rate_power=float(rule.hyper.get("learning_rate_power", -0.5)),
                admit_after=opts.admit_after,
                evict_after=-1 if opts.evict_after_steps is None else opts.evict_after_steps,
                slot_initial=list(self.slots.values()))

    def evict(self, keys, live_count) -> tf.Operation:
        """Removes `keys`; the live rows among them (`live_count`, which the op counts itself)
        count as evicted."""
        del live_count
        with tf.device(self.device):
            return self._ops.parallax_kv_remove(self.handle, keys, count_evicted=True).op

    # ---- whole contents (checkpoints, results) ----------------------------------------------------
    def export(self) -> Dict[str, tf.Tensor]:
        """Live rows (ids, values, the slots stacked as `slot_values`) and every tracked id's
        counters, in one op; `unpack` gives the fetched arrays store.Shard.export's keys."""
        with tf.device(self.device), tf.control_dependencies(settled(self.device)):
            ids, values, slot_values, seen, counts, last_seen, _, clock = self._ops.parallax_kv_export(
                self.handle, slots=len(self.slots))
            return dict(ids=ids, values=values, slot_values=slot_values, seen_ids=seen, counts=counts,
                        last_seen=last_seen, clock=clock)

    def unpack(self, fetched: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """export's fetched arrays with each slot under its own name, [rows, dim]."""
        out = dict(fetched)
        stacked = out.pop("slot_values")
        for k, slot in enumerate(self.slots):
            out[slot] = np.asarray(stacked[k]).reshape(-1, self.options.dim)
        out["values"] = np.asarray(out["values"]).reshape(-1, self.options.dim)
        return out

    def load_whole(self, whole: Dict[str, tf.Tensor], index: int, shards: int) -> tf.Operation:
        """Replaces the shard's contents with its ids' part of the whole table's arrays (export's
        keys over every shard, the slots stacked as `slot_values` in this shard's slot order,
        "live": 1 for each of seen_ids that has a row): shard `index` of `shards` keeps the ids it
        owns, in one op."""
        with tf.device(self.device):
            return self._ops.parallax_kv_import(self.handle, whole["ids"], whole["values"], whole["slot_values"],
                                                whole["seen_ids"], whole["counts"], whole["last_seen"],
                                                whole["live"], whole["clock"], shard=index, shards=shards)


def compiles(options: TableOptions) -> bool:
    """Whether a table of these options trains in compiled ops alone (its rows float32, its
    initial row law computed inside them): what a table replicated on the ranks needs."""
    return holds(options) and options.initializer.compiled_law(options.dim, options.seed) is not None


def fusable(shards) -> bool:
    """Whether read_many can answer reads of these shards: compiled ones whose laws compile."""
    return all(isinstance(shard, CompiledShard) and shard.law is not None for shard in shards)


def read_many(shards: List[CompiledShard], message, rank: int = -1, ranks: int = 1) -> tf.Tensor:
    """One op on the shards' server answering every read of one rank's message there: `message`
    holds each read's id count, then each read's ids (shards[k] answers read k); the rows come
    back flattened, read after read. Every shard's initial row law must compile (`law`). With a
    `rank`, the read waits until boundary_many has applied every push that rank made there."""
    return compiled_ops.load().parallax_kv_read_many(
        message, shared_names=[shard.shared_name for shard in shards], dims=[shard.options.dim for shard in shards],
        admit_on_first_use=[shard.options.admit_after == 1 for shard in shards],
        pushes=_pushes_name(shards[0].device) if rank >= 0 else "", rank=rank, ranks=ranks, **_laws(shards))


SETTLED = "parallax_dynamic_settled"     # graph collection: ops after which a server's exports read


def settle(shards: List[CompiledShard], rank: int, ranks: int) -> None:
    """Makes the exports of the shards' server (built later: state.DynamicState) wait, as a
    read of `rank` does, for the boundary of that rank's last push there."""
    with tf.control_dependencies(None), tf.device(shards[0].device):
        empty = tf.zeros([len(shards)], tf.int64)
        tf.compat.v1.add_to_collection(SETTLED, read_many(shards, empty, rank, ranks).op)


def settled(device) -> list:
    """The ops an export on `device` waits for (settle)."""
    where = tf.DeviceSpec.from_string(device or "")
    return [op for op in tf.compat.v1.get_collection(SETTLED) if tf.DeviceSpec.from_string(op.device) == where]


def _pushes_name(device) -> str:
    return f"parallax_kv_pushes/{device or 'local'}"


def message(ids: List[tf.Tensor]) -> tf.Tensor:
    """read_many's and push's message of several id vectors: their counts, then the ids."""
    return tf.concat([tf.stack([tf.size(part, out_type=tf.int64) for part in ids])] + list(ids), 0)


def push(shards: List[CompiledShard], ids_message, payload, rank: int, ranks: int) -> tf.Operation:
    """One op on the shards' server storing this rank's push of the step: per shard, its
    distinct ids (`ids_message`: as read_many's message, shards[k]'s ids k-th); `payload` their
    [ids, dim + 1] rows (gradient, occurrences), flattened shard after shard. boundary_many takes
    every rank's."""
    return compiled_ops.load().parallax_kv_push(
        ids_message, payload, dims=[shard.options.dim for shard in shards], pushes=_pushes_name(shards[0].device),
        rank=rank, ranks=ranks)


def push_all(shards: List[CompiledShard], messages, payloads, ranks: int) -> tf.Operation:
    """push for every rank at once, from the concatenations of the ranks' messages and of their
    payloads, rank after rank (a replicated table's allgathered pushes)."""
    return compiled_ops.load().parallax_kv_push_all(
        messages, payloads, dims=[shard.options.dim for shard in shards], pushes=_pushes_name(shards[0].device),
        ranks=ranks)


def boundary_many(shards: List[CompiledShard], rules: list, ranks: int) -> tf.Operation:
    """One op on the shards' server that waits for every rank's push (`push`, the same shards in
    the same order), sums them per id, averages the gradients over the ranks and runs each
    shard's boundary with its rule (`rules[k]` for shards[k]), initial rows computed inside."""
    for shard, rule in zip(shards, rules):
        shard.with_slots(rule.slots)
    values = [rule.hyper[name] for rule in rules for name in HYPER_ORDER[rule.kind]]
    if all(isinstance(value, (int, float)) for value in values):
        hyper = tf.constant(values, tf.float32, shape=[len(values)])
    else:
        hyper = tf.stack([rule.value(name, tf.float32) for rule in rules for name in HYPER_ORDER[rule.kind]])
    return compiled_ops.load().parallax_kv_boundary_many(
        hyper, pushes=_pushes_name(shards[0].device), ranks=ranks,
        shared_names=[shard.shared_name for shard in shards], dims=[shard.options.dim for shard in shards],
        kinds=[rule.kind for rule in rules], nesterov=[bool(rule.hyper.get("nesterov", False)) for rule in rules],
        learning_rate_powers=[float(rule.hyper.get("learning_rate_power", -0.5)) for rule in rules],
        admit_after=[shard.options.admit_after for shard in shards],
        evict_after=[-1 if shard.options.evict_after_steps is None else shard.options.evict_after_steps
                     for shard in shards],
        slot_counts=[len(shard.slots) for shard in shards],
        slot_initial=[value for shard in shards for value in shard.slots.values()], **_laws(shards))


def counters_many(shards: List[CompiledShard]) -> tf.Tensor:
    """int64 [shards, 4]: each shard's live rows, boundaries so far, rows admitted, rows evicted."""
    return compiled_ops.load().parallax_kv_counters_many(
        shared_names=[shard.shared_name for shard in shards], dims=[shard.options.dim for shard in shards])


def _laws(shards) -> dict:
    """The shards' initial row laws as the compiled ops' attrs (the doubles exact, in a tensor
    attr: no constant runs each step)."""
    laws = [shard.law for shard in shards]
    return dict(law_kinds=[kind for kind, _, _, _ in laws], salts=[salt for _, _, _, salt in laws],
                law_values=tf.make_tensor_proto(np.array([[a, b] for _, a, b, _ in laws], np.float64)))
