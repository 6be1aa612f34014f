"""The alltoall route's step: every rank's gradient rows of a rank-sharded variable go to their
owners, which average and apply them (the lookups' exchange: rewriters/shared/alltoall_lookup.py)."""
from __future__ import annotations

from typing import Dict, List

import tensorflow as tf

from parallax_tf.inspect_graph import logical_name
from parallax_tf.plan import RANKS_LAYOUT, ROUTE_ALLTOALL
from rewriters.shared.pipeline import SyncRoute
from rewriters.shared.step_report import lower_bound_bytes


class AlltoallRoute(SyncRoute):
    """The gradients' way back: every rank's rows to their owners, averaged there."""

    def __init__(self, request, rebuilt, entries):
        self.request, self.rebuilt, self.entries = request, rebuilt, entries
        self.bytes, self.lower_bound = {}, []
        self.shards = [part.variable for e in entries for part in rebuilt.parts[e.name]]

    def build(self) -> Dict[str, object]:
        import horovod.tensorflow as hvd
        topo = self.request.topology
        size, hosts = topo.size, len(topo.ranks_per_host)
        averaged, moved = {}, []
        for entry in self.entries:
            for part, grad in zip(self.rebuilt.parts[entry.name], self.rebuilt.grads[entry.name]):
                if grad is None:
                    continue
                var = part.variable
                row_bytes = var.dtype.base_dtype.size * max(1, int(var.shape[1:].num_elements() or 1))
                ids, values = [], []
                for exchange, rows in self.rebuilt.exchanged[var.op.name]:
                    summed = tf.math.unsorted_segment_sum(rows, exchange.position, exchange.num_distinct)
                    back, _ = hvd.alltoall(tf.gather(summed, exchange.order), splits=exchange.splits,
                                           name=f"{exchange.tag}_grads")
                    ids.append(exchange.served)
                    values.append(back)
                    moved.append(exchange.away * (2 * row_bytes + 8))
                ids, values = (tf.concat(t, 0) if len(t) > 1 else t[0] for t in (ids, values))
                rows, where = tf.unique(ids)
                total = tf.math.unsorted_segment_sum(values, where, tf.size(rows))
                averaged[var.op.name] = tf.IndexedSlices(total / tf.cast(size, total.dtype), rows,
                                                         tf.shape(var, out_type=tf.int64))
                self.lower_bound.append(lower_bound_bytes(grad, var, size, hosts))
        self.bytes[ROUTE_ALLTOALL] = tf.add_n(moved) if moved else tf.constant(0, tf.int64)
        return averaged

    def kept_per_rank(self) -> List:
        """The shards and what was made in their shape (optimizer slots, moving-average shadows):
        each rank's own rows, never broadcast."""
        rows = {var.op.name: var.shape[0] for var in self.shards}
        slots = [optimizer.get_slot(var, name) for apply in self.rebuilt.training.applies
                 for optimizer in [apply.optimizer] for var in self.shards for name in optimizer.get_slot_names()]
        shadows = [v for v in tf.compat.v1.global_variables() if v.shape.rank and any(
            v.op.name.startswith(name + "/") and v.shape[0] == n for name, n in rows.items())]
        kept = {v.name: v for v in list(self.shards) + [s for s in slots if s is not None] + shadows}
        return list(kept.values())

    def layouts(self) -> Dict[str, str]:
        """Saved name -> "ranks" for the state made in the shards' shape (the shards' own entries
        have it from the plan)."""
        return {logical_name(v): RANKS_LAYOUT for v in self.kept_per_rank()[len(self.shards):]}
