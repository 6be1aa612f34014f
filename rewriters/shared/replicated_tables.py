"""The synchronous step's part for dynamic tables replicated on the ranks (the plan's route
"replicated"): every rank holds each such table whole, in one compiled shard on its own worker.

A rank reads its batch's rows from its own copy, one op for every such table, and no message
leaves it. At the step's end it allgathers its push (per table its distinct ids, and per id the
gradient row and the occurrences: a server's push, rewriters/shared/dynamic_step.py) and applies
every rank's push to its copy: compiled.push_all, then compiled.boundary_many, which sums the
pushes per id in rank order. Every copy so makes the same float operations in the same order as
every other, and as a server's boundary does: the copies stay identical, and equal to what one
process trains. Rank 0's copy is what checkpoints and results read (dynamic/state.py loads
every rank's).

Against the servers, a step moves (N - 1) pushes into each rank instead of the reads' rows and
the pushes between ranks and servers, and has no round trip to a server before the next read;
each rank runs the boundary of every rank's ids, and holds the whole table."""
from __future__ import annotations

from typing import Dict, List

import tensorflow as tf

from parallax_tf.dynamic import compiled
from parallax_tf.dynamic import routes
from parallax_tf.dynamic import table as table_lib
from rewriters.shared.step_report import tensor_bytes
from rewriters.shared.transform import rewire


class ReplicatedTables:
    """The reads (built at once: they replace the lookups' stand-ins) and, by `build`, the
    pushes and boundaries of the replicated tables' lookups `found` on this rank."""

    def __init__(self, topo, found: List["table_lib.Lookup"]):
        self.topo, self.found = topo, found
        self.device = found[0].table.shards[0].device
        self.ended: List[tf.Operation] = []
        self.counters: Dict[str, tf.Tensor] = {}
        self.moved: List[tf.Tensor] = []
        route = routes.Route([look.table.shards for look in found])
        ids = [look.ids for look in found]
        self._read_message = route.messages(ids)[self.device]
        with tf.device(self.device):
            flat = compiled.read_many(route.shards_on(self.device), self._read_message)
        for look, rows in zip(found, route.gather(ids, {self.device: flat}, [look.table.dim for look in found])):
            rewire(look.stand_in, rows, set(look.stand_in.consumers()))

    def build(self, entries: list, model_optimizer) -> None:
        """This rank's push allgathered, every rank's applied to its copy, each table's capacity
        kept; `entries`: per table, (the table, its distinct ids of this batch, their [ids, dim +
        1] payload of gradient rows and occurrences)."""
        import horovod.tensorflow as hvd
        topo = self.topo
        tables = [table for table, _, _ in entries]
        shards = [table.shards[0] for table in tables]
        route = routes.Route([[shard] for shard in shards])
        ids = [item[1] for item in entries]
        payload = route.spread(ids, [item[2] for item in entries])[self.device]
        # one lookup per table, in the tables' order: the reads' message holds the pushed ids
        message = self._read_message if [look.table for look in self.found] == tables else \
            route.messages(ids)[self.device]
        if topo.size > 1:
            self.moved += [tensor_bytes(message) * (topo.size - 1), tensor_bytes(payload) * (topo.size - 1)]
            message = hvd.allgather(message, name="parallax_replicated_tables_ids")
            payload = hvd.allgather(payload, name="parallax_replicated_tables_rows")
        with tf.device(self.device):
            pushed = compiled.push_all(shards, message, payload, topo.size)
            with tf.control_dependencies([pushed]):
                boundary = compiled.boundary_many(shards, [table.rule(model_optimizer) for table in tables], topo.size)
            self.ended = [table.end_step([boundary]) for table in tables]
            with tf.control_dependencies(self.ended):
                packed = compiled.counters_many(shards)
        packed.set_shape([len(shards), 4])
        for shard, row in zip(shards, tf.unstack(packed)):     # rows, admitted, evicted
            self.counters[shard.name] = tf.gather(row, [0, 2, 3])

    @property
    def bytes(self) -> tf.Tensor:
        return tf.add_n(self.moved) if self.moved else tf.constant(0, tf.int64)
