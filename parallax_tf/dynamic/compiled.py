"""One shard of a dynamic table in parallax_tf's compiled hash map (ops/kv_table_ops.cc): the
interface of store.Shard, whose standard-op tables stay the reference and what a served model
reads. A read is one op and the step boundary one op per shard and step; the row rule is the
same data (rules.RowRule) the standard form reads."""
from __future__ import annotations

from typing import Dict, Optional

import tensorflow as tf

from parallax_tf import ops as compiled_ops
from parallax_tf.dynamic.store import TableOptions


class CompiledShard:
    """Shard `index` of table `name` on `device`; its slots are fixed by the first boundary's rule
    (the optimizer is known then), so the resource is made there or by `with_slots`."""

    def __init__(self, name: str, index: int, device: Optional[str], options: TableOptions):
        if options.dtype != tf.float32:
            raise ValueError(f"the compiled table backend holds float32 rows; table {name!r} is {options.dtype.name}")
        self.name, self.index, self.device, self.options = name, index, device, options
        self._shared_name = f"parallax_kv/{name}/shard{index}"
        self._handle = None
        self.slots: Dict[str, float] = {}

    def with_slots(self, slots) -> None:
        if self._handle is not None:
            if [s for s, _ in slots] != list(self.slots):
                raise ValueError(f"table {self.name!r}: its shard holds slots {list(self.slots)}, a rule asks for "
                                 f"{[s for s, _ in slots]}")
            return
        self.slots = dict(slots)
        with tf.control_dependencies(None), tf.device(self.device):
            self._handle = compiled_ops.load().parallax_kv_shard(
                dim=self.options.dim, slots=len(self.slots), shared_name=self._shared_name,
                name=self._shared_name.replace("/", "_"))

    @property
    def handle(self):
        if self._handle is None:
            raise ValueError(f"table {self.name!r}: its compiled shard is made once its optimizer is known")
        return self._handle

    def initial_rows(self, ids):
        opts = self.options
        return opts.initializer.rows(ids, opts.dim, opts.seed, opts.dtype)

    def read(self, ids) -> tf.Tensor:
        opts = self.options
        with tf.device(self.device):
            initial = self.initial_rows(ids) if opts.admit_after == 1 else tf.zeros([tf.size(ids), opts.dim])
            rows = compiled_ops.load().parallax_kv_read(self.handle, ids, initial,
                                                         admit_on_first_use=opts.admit_after == 1)
            rows.set_shape([None, opts.dim])
            return rows

    def boundary(self, ids, grads, counts, rule) -> tf.Operation:
        opts = self.options
        self.with_slots(rule.slots)
        names = _HYPER[rule.kind]
        with tf.device(self.device):
            hyper = tf.stack([rule.value(n, tf.float32) for n in names])
            return compiled_ops.load().parallax_kv_boundary(
                self.handle, ids, grads, tf.cast(counts, tf.int64), self.initial_rows(ids), hyper, kind=rule.kind,
                nesterov=bool(rule.hyper.get("nesterov", False)),
                learning_rate_power=float(rule.hyper.get("learning_rate_power", -0.5)),
                admit_after=opts.admit_after,
                evict_after=-1 if opts.evict_after_steps is None else opts.evict_after_steps,
                slot_initial=[float(v) for v in self.slots.values()])

    def export(self) -> Dict[str, tf.Tensor]:
        with tf.device(self.device):
            ids, values, slot_values, seen, counts, last_seen, live, clock = compiled_ops.load().parallax_kv_export(
                self.handle)
            out = dict(ids=ids, values=values, seen_ids=seen, counts=counts, last_seen=last_seen, clock=clock)
            out.update({slot: slot_values[k] for k, slot in enumerate(self.slots)})
            out["live"] = live
            return out


_HYPER = dict(sgd=["learning_rate"], momentum=["learning_rate", "momentum"], adagrad=["learning_rate"],
              adam=["learning_rate", "beta1", "beta2", "epsilon"],
              ftrl=["learning_rate", "l1", "l2", "beta", "l2_shrinkage"])
