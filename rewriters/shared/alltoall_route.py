"""The alltoall route's step: every rank's gradient rows of a rank-sharded variable go to their
owners, which average and apply them (the lookups' exchange: rewriters/shared/alltoall_lookup.py)."""
from __future__ import annotations

from typing import Dict, List

import tensorflow as tf

from parallax_tf import routes
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
        topo = self.request.topology
        size, hosts = topo.size, len(topo.ranks_per_host)
        own, moved = {}, []           # variable op name -> its lookups' gradient rows, per lookup
        for entry in self.entries:
            for part, grad in zip(self.rebuilt.parts[entry.name], self.rebuilt.grads[entry.name]):
                if grad is not None:
                    own[part.variable.op.name] = dict((look.index, rows) for look, rows
                                                      in self.rebuilt.exchanged[part.variable.op.name])
                    self.lower_bound.append(lower_bound_bytes(grad, part.variable, size, hosts))
        arrived = {}                  # (pack, lookup index) -> the rows every rank sent for it
        for pack in self.rebuilt.packs:
            # lookups of a variable without a gradient send nothing back (the same on every rank)
            graded = [look for look in pack.lookups if look.index in own.get(look.variable.op.name, {})]
            sent = []
            for look in graded:
                rows = own[look.variable.op.name][look.index]
                summed = tf.math.unsorted_segment_sum(rows, look.position, look.num_distinct)
                sent.append(tf.gather(summed, look.order))
                row_bytes = pack.dtype.size * look.row_elements
                moved.append(look.away * (2 * row_bytes + 8))
            if not graded:
                continue
            received = pack.unpack(pack.send(sent, [look.counts for look in graded], "grads", graded),
                                   [look.served_counts for look in graded], graded)
            arrived.update({(id(pack), look.index): rows for look, rows in zip(graded, received)})
        averaged = {}
        for name in own:
            looks = [look for look, _ in self.rebuilt.exchanged[name]]
            ids = tf.concat([look.served for look in looks], 0)
            values = tf.concat([arrived[(id(look.pack), look.index)] for look in looks], 0)
            rows, where = tf.unique(ids)
            total = tf.math.unsorted_segment_sum(values, where, tf.size(rows))
            var = looks[0].variable
            averaged[name] = tf.IndexedSlices(total / tf.cast(size, total.dtype), rows,
                                              tf.shape(var, out_type=tf.int64))
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


routes.build_with(ROUTE_ALLTOALL, AlltoallRoute)
