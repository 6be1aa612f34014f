"""The synchronous step's part for dynamic tables (parallax_tf.dynamic): every rank pushes, per
shard, the distinct ids its batch read with their gradients and occurrences to the shard's
server; rank 0 takes every rank's push, sums them per id and runs the shard's step boundary
there (the optimizer's row rule, admission, eviction). A rank reads its next batch's rows only
once the boundary took its push, so every rank reads the table the last boundary left, and a
dynamic table trains exactly as in one process.

Where a server's shards are compiled (dynamic/compiled.py), a rank's reads there are one op,
its push one op and rank 0's boundary one op for all of them, and the read itself waits for the
boundary; other shards push into an accumulator each and end the step in standard ops, and
rank 0 then hands every other rank a token that its step waits for.

Every tensor crossing between tasks is a RecvTensor call of its own, so a rank's messages to
one server are packed, however many tables and shards live there (as rewriters/shared/
ps_packing.py packs the PS route's): one message of ids and one of rows per server for the
reads, one of gradients for the pushes (a table read by one lookup pushes onto the ids the
server already received), one per server for rank 0's counters."""
from __future__ import annotations

from typing import Dict, List

import tensorflow as tf

from parallax_tf.dynamic import compiled
from parallax_tf.dynamic import table as table_lib
from rewriters.shared.step_report import tensor_bytes
from rewriters.shared.transform import rewire

NEVER_STALE = 2 ** 62     # every push's time step: see rewriters/shared/ps_route.py


class DynamicTablesStep:
    """Builds the pushes on every rank and, on rank 0, the boundaries and the tokens."""

    def __init__(self, request, rebuilt):
        self.topo = request.topology
        self.pushes: List[tf.Operation] = []
        self.push_on: Dict[str, tf.Operation] = {}      # server -> this rank's push there
        self.fused: Dict[str, list] = {}                # server -> its shards, pushed to in one compiled op
        self.boundaries: List[tf.Operation] = []
        self.counters: Dict[str, tf.Tensor] = {}
        self.lower_bound: list = []
        found = table_lib.lookups(rebuilt.loss.graph)
        self.messages: Dict[str, tuple] = {}            # server -> (the reads' message, the shards it reads)
        moved = _pack_reads([read for look in found for read in look.reads], self.topo, self.messages)
        if found:
            self._build(rebuilt, found, moved)
        self.bytes = {"dynamic": tf.add_n(moved) if moved else tf.constant(0, tf.int64)}

    def _build(self, rebuilt, found, moved: list) -> None:
        model_optimizer = table_lib.model_optimizer(rebuilt.training.applies)
        grads = dict(zip((id(look) for look in found), _row_gradients(rebuilt, [look.rows for look in found])))
        sent = []            # (shard, ids as its device sees them, payload on the worker, reads to wait for,
                             # whether the ids cross again)
        for table in table_lib.tables(rebuilt.loss.graph):
            mine = [look for look in found if look.table is table]
            if not mine:
                continue
            for shard in table.shards:      # every rank knows the slots: its results and checkpoints read them
                shard.with_slots(table.rule(model_optimizer).slots)
            reads = [look.rows.op for look in mine]
            if len(mine) == 1:              # the ids its reads sent: the server has them already
                look = mine[0]
                payload = _payload(_dense(grads[id(look)], look.rows), look.counts)
                for read in look.reads:
                    part = payload if read.where is None else tf.gather(payload, read.where)
                    sent.append((read.shard, read.ids_on_server, part, reads, False))
            else:
                distinct, summed, counts = table_lib.merged([(look, grads[id(look)]) for look in mine])
                for shard, (ids, part) in zip(table.shards, table_lib.partition(
                        distinct, [_payload(summed, counts)], len(table.shards))):
                    sent.append((shard, ids, part, reads, True))
        self._push(sent, moved)
        if self.topo.is_chief:
            self._boundaries(found, model_optimizer)

    def _push(self, sent, moved: list) -> None:
        """Per server, every payload in one message: one compiled push where the server's shards
        are compiled, else split there into each shard's accumulator."""
        by_device: Dict[str, list] = {}
        for item in sent:
            by_device.setdefault(item[0].device, []).append(item)
        for device, items in sorted(by_device.items(), key=lambda kv: str(kv[0])):
            items, ids_message = self._in_message_order(device, items)
            with tf.control_dependencies([op for item in items for op in item[3]]):
                flat = tf.concat([tf.reshape(item[2], [-1]) for item in items], 0)
            if self.topo.crosses_processes(device):
                moved.append(tensor_bytes(flat))
                moved.extend(tensor_bytes(ids) for _, ids, _, _, crossing in items if crossing)
            shards = [item[0] for item in items]
            with tf.device(device):
                if compiled.fusable(shards) and len({id(shard) for shard in shards}) == len(shards):
                    self.fused[device] = shards
                    if ids_message is None:     # made on the server from the ids it holds
                        ids_message = compiled.message([item[1] for item in items])
                    self.push_on[device] = compiled.push(shards, ids_message, flat, self.topo.rank, self.topo.size)
                else:
                    if device in self.messages:
                        raise AssertionError(f"the fused reads on {device} would wait for a compiled push there")
                    widths = [int(item[2].shape[1]) for item in items]
                    sizes = tf.stack([tf.size(item[1]) * width for item, width in zip(items, widths)])
                    pieces = tf.split(flat, sizes, num=len(items))
                    self.push_on[device] = tf.group(*[
                        _push(_accumulator(item[0], width, piece.dtype), item[1], tf.reshape(piece, [-1, width]))
                        for item, piece, width in zip(items, pieces, widths)])
                self.pushes.append(self.push_on[device])

    def _in_message_order(self, device, items) -> tuple:
        """(`items`, None), or, when they push onto exactly the ids of the server's read message
        (nothing more crosses), (`items` in its order, that message)."""
        sent, read_shards = self.messages.get(device, (None, []))
        at = {id(shard): k for k, shard in enumerate(read_shards)}
        if any(item[4] for item in items) or sorted(at.get(id(item[0]), -1) for item in items) != list(range(len(at))):
            return items, None
        return sorted(items, key=lambda item: at[id(item[0])]), sent

    def _boundaries(self, found, model_optimizer) -> None:
        """Rank 0: every shard takes every rank's push and ends the step (one compiled op per
        server where its shards are compiled); per server, one group of them and one tensor of
        counters. Each waits for this rank's own push there only (a wait on every push would
        cross servers)."""
        size = self.topo.size
        trained = [table for table in table_lib.tables(found[0].rows.graph)
                   if any(look.table is table for look in found)]
        rules = {table.name: table.rule(model_optimizer) for table in trained}
        fused = {}
        for device, shards in self.fused.items():
            with tf.device(device), tf.control_dependencies([self.push_on[device]]):
                fused[device] = compiled.boundary_many(shards, [rules[shard.name] for shard in shards], size)
        ended_on: Dict[str, list] = {}
        for table in trained:
            boundaries = [fused[shard.device] if shard.device in fused else
                          self._taken_boundary(shard, rules[table.name]) for shard in table.shards]
            ended = table.end_step(boundaries)
            for shard in table.shards:
                ended_on.setdefault(shard.device, []).append(ended)
        for device in sorted(ended_on, key=str):
            shards = self.fused.get(device) or [shard for table in trained for shard in table.shards
                                                if shard.device == device]
            with tf.device(device):
                self.boundaries.append(tf.group(*ended_on[device]))
                with tf.control_dependencies(ended_on[device]):
                    packed = compiled.counters_many(shards) if device in self.fused else \
                        tf.stack([shard.counters() for shard in shards])
            packed.set_shape([len(shards), 4])
            for shard, row in zip(shards, tf.unstack(packed)):     # rows, admitted, evicted
                self.counters[shard.name] = self.counters.get(shard.name, 0) + tf.gather(row, [0, 2, 3])

    def _taken_boundary(self, shard, rule) -> tf.Operation:
        """A shard's boundary on what its accumulator took from every rank."""
        size, dim = self.topo.size, shard.options.dim
        with tf.device(shard.device), tf.control_dependencies([self.push_on[shard.device]]):
            taken = _accumulator(shard, dim + 1, shard.options.dtype).take_indexed_slices_grad(size)
            taken.indices.set_shape([None])
            taken.values.set_shape([None, dim + 1])
            distinct, position = tf.unique(taken.indices, out_idx=tf.int32)
            summed = tf.math.unsorted_segment_sum(taken.values, position, tf.size(distinct))
            mean = summed[:, :-1] / tf.cast(size, summed.dtype)
            occurrences = tf.cast(tf.round(summed[:, -1]), tf.int64)
            return shard.boundary(distinct, mean, occurrences, rule)

    @property
    def active(self) -> bool:
        return bool(self.pushes)

    @property
    def _tokens(self) -> bool:
        """Whether a server ends the step in standard ops, whose reads do not wait for it."""
        return any(device not in self.fused for device in self.push_on)

    def targets(self) -> list:
        """What this rank's step adds: rank 0, the boundaries (and then every other rank's
        token); another rank, its pushes (and the wait for its token)."""
        topo = self.topo
        if topo.is_chief:
            released = []
            if self._tokens:
                with tf.control_dependencies(self.boundaries):
                    released = [_token_queue(rank, topo).enqueue(tf.zeros([1], tf.float64))
                                for rank in range(1, topo.size)]
            return [tf.group(*self.boundaries, *released)]
        if not self._tokens:
            return list(self.pushes)
        with tf.control_dependencies(self.pushes):
            token = _token_queue(topo.rank, topo).dequeue()
        return self.pushes + [token.op]


def _pack_reads(reads: List["table_lib.ShardRead"], topo, messages: Dict[str, tuple]) -> list:
    """Rewires the reads of each server (and dtype) into one message of ids and one of rows;
    sets every read's ids_on_server and, per server whose reads are fused, `messages` (the
    message, the shards it reads in order). A fused read waits for the boundary of this rank's
    last push there (the step pushes to exactly the shards it read); so does the export of
    those shards' state (compiled.settle). Returns the bytes that cross, per message."""
    remote = topo.crosses_processes
    by_device: Dict[tuple, list] = {}
    for read in reads:
        read.ids_on_server = read.ids
        by_device.setdefault((read.shard.device, read.rows.dtype), []).append(read)
    moved = []
    for (device, _), group in sorted(by_device.items(), key=lambda kv: str(kv[0][0])):
        if len(group) > 1 or group[0].deferred:
            counts = tf.stack([tf.size(read.ids, out_type=tf.int64) for read in group])
            sent = tf.concat([counts] + [read.ids for read in group], 0)
            with tf.device(device):
                on_server = tf.split(sent[len(group):], sent[:len(group)], num=len(group))
                shards = [read.shard for read in group]
                if compiled.fusable(shards):        # one op for the whole message
                    packed = compiled.read_many(shards, sent, topo.rank, topo.size)
                    messages[device] = (sent, shards)
                    compiled.settle(shards, topo.rank, topo.size)
                else:
                    packed = tf.concat([tf.reshape(read.shard.read(ids), [-1]) for read, ids in zip(group, on_server)], 0)
            widths = tf.constant([read.shard.options.dim for read in group], tf.int64)
            for read, ids, piece in zip(group, on_server, tf.split(packed, counts * widths, num=len(group))):
                new = tf.reshape(piece, [-1, read.shard.options.dim])
                new.set_shape(read.rows.shape)
                rewire(read.rows, new, set(read.rows.consumers()))
                read.rows, read.ids_on_server = new, ids
            if remote(device):
                moved += [tensor_bytes(sent), tensor_bytes(packed)]
        elif remote(device):
            moved += [tensor_bytes(group[0].ids), tensor_bytes(group[0].rows)]
    return moved


def _dense(grad, rows) -> tf.Tensor:
    return tf.zeros_like(rows) if grad is None else tf.convert_to_tensor(grad)


def _payload(grads, counts) -> tf.Tensor:
    """[n, dim + 1]: each id's gradient rows and its occurrences."""
    return tf.concat([grads, tf.cast(counts, grads.dtype)[:, None]], 1)


def _accumulator(shard, width: int, dtype):
    name = f"parallax_dynamic/{shard.name}/shard{shard.index}/grads"
    with tf.control_dependencies(None), tf.device(shard.device):
        return tf.compat.v1.SparseConditionalAccumulator(dtype, shape=tf.TensorShape([None, width]),
                                                         shared_name=name, name=name.replace("/", "_"),
                                                         reduction_type="SUM")


def _push(accumulator, ids, payload) -> tf.Operation:
    shape = tf.constant([-1, int(payload.shape[1])], tf.int64)
    return accumulator.apply_indexed_slices_grad(tf.IndexedSlices(payload, ids, shape),
                                                 local_step=tf.constant(NEVER_STALE, tf.int64))


def _token_queue(rank: int, topo):
    """Rank `rank`'s token queue on its host's server (one per rank: see ps_route._token_queue)."""
    with tf.control_dependencies(None), tf.device(f"/job:ps/task:{topo.host_of(rank)}"):
        return tf.queue.FIFOQueue(4, [tf.float64], shapes=[[1]], shared_name=f"parallax_dynamic_token_{rank}",
                                  name=f"parallax_dynamic_token_{rank}")


def _row_gradients(rebuilt, rows: list) -> list:
    """The objective's gradient for each lookup's rows: the loss's, or the sum over a traced
    step's gradient calls (training_record.Training.row_targets)."""
    targets = rebuilt.training.row_targets
    if not targets:
        return tf.gradients(rebuilt.loss, rows)
    per_call = [tf.gradients(ys, rows, grad_ys) for ys, grad_ys in targets]
    summed = []
    for found in zip(*per_call):
        found = [g for g in found if g is not None]
        summed.append(None if not found else found[0] if len(found) == 1 else tf.add_n(
            [tf.convert_to_tensor(g) for g in found]))
    return summed
