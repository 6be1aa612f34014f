"""The synchronous step's part for dynamic tables (parallax_tf.dynamic): every rank pushes, per
shard, the distinct ids its batch read with their gradients and occurrences to the shard's
server; rank 0 takes every rank's push, sums them per id and runs the shard's step boundary
there (the optimizer's row rule, admission, eviction). A rank reads its next batch's rows only
once the boundary took its push, so every rank reads the table the last boundary left, and a
dynamic table trains exactly as in one process.

Tables whose shards compile (dynamic/compiled.py) are routed together (dynamic/routes.py): one
op on the rank splits every lookup's ids into one message per server, where one op answers
it and waits for the boundary of this rank's last push itself; one op gathers the answers
into each lookup's rows; one op spreads the gradients into one push per server, on the reads'
message when each table was read once; rank 0's boundary is one op per server. Other tables
read shard by shard, push into an accumulator per shard and end the step in standard ops; rank
0 then hands every other rank a token its step waits for.

Tables replicated on the ranks (the plan's route "replicated") are read and trained on every
rank's own copy (rewriters/shared/replicated_tables.py); their pushes never reach a server.

Every tensor crossing between tasks is a RecvTensor call of its own, so a rank's messages to
one server are packed, however many tables and shards live there (as rewriters/shared/
ps_packing.py packs the PS route's)."""
from __future__ import annotations

from typing import Dict, List

import tensorflow as tf

from parallax_tf.dynamic import compiled
from parallax_tf.dynamic import routes
from parallax_tf.dynamic import table as table_lib
from rewriters.shared.replicated_tables import ReplicatedTables
from rewriters.shared.step_report import tensor_bytes
from rewriters.shared.transform import rewire

NEVER_STALE = 2 ** 62     # every push's time step: see rewriters/shared/ps_route.py


class DynamicTablesStep:
    """Builds the reads and pushes on every rank and, on rank 0, the boundaries (and tokens)."""

    def __init__(self, request, rebuilt):
        self.topo = request.topology
        self.pushes: List[tf.Operation] = []
        self.push_on: Dict[str, tf.Operation] = {}      # server -> this rank's pushes into its accumulators
        self.routed_push: Dict[str, tf.Operation] = {}  # server -> this rank's compiled push there
        self.fused: Dict[str, list] = {}                # server -> the shards of its compiled push, in order
        self.boundaries: List[tf.Operation] = []
        self.counters: Dict[str, tf.Tensor] = {}
        self.lower_bound: list = []
        found = table_lib.lookups(rebuilt.loss.graph)
        copied = [look for look in found if look.table.replicated]
        self.replicated = ReplicatedTables(self.topo, copied) if copied else None
        routed = [look for look in found if look.stand_in is not None and not look.table.replicated]
        moved = _pack_reads([read for look in found for read in look.reads], self.topo.crosses_processes)
        self.read_messages = self._route_reads(routed, moved) if routed else {}
        if found:
            self._build(rebuilt, found, moved)
        if self.replicated is not None:
            moved.append(self.replicated.bytes)
            self.counters.update(self.replicated.counters)
        self.bytes = {"dynamic": tf.add_n(moved) if moved else tf.constant(0, tf.int64)}

    def _route_reads(self, routed, moved: list) -> Dict[str, tf.Tensor]:
        """Every routed lookup's rows through one message per server; a server's read waits for
        the boundary of this rank's last push there, and so do its exports (compiled.settle).
        Returns the messages."""
        topo = self.topo
        route = routes.Route([look.table.shards for look in routed])
        ids = [look.ids for look in routed]
        sent = route.messages(ids)
        answers = {}
        for device in route.devices:
            shards = route.shards_on(device)
            with tf.device(device):
                answers[device] = compiled.read_many(shards, sent[device], topo.rank, topo.size)
            compiled.settle(shards, topo.rank, topo.size)
            if topo.crosses_processes(device):
                moved += [tensor_bytes(sent[device]), tensor_bytes(answers[device])]
        for look, rows in zip(routed, route.gather(ids, answers, [look.table.dim for look in routed])):
            rewire(look.stand_in, rows, set(look.stand_in.consumers()))
        return sent

    def _build(self, rebuilt, found, moved: list) -> None:
        model_optimizer = table_lib.model_optimizer(rebuilt.training.applies)
        grads = dict(zip((id(look) for look in found), _row_gradients(rebuilt, [look.rows for look in found])))
        sent = []            # (shard, ids as its device sees them, payload on the worker, reads to wait for,
                             # whether the ids cross again)
        routed = []          # (table, its pushed ids, payload, whether the ids are one lookup's)
        copied = []          # (table replicated on the ranks, its pushed ids, payload)
        for table in table_lib.tables(rebuilt.loss.graph):
            mine = [look for look in found if look.table is table]
            if not mine:
                continue
            for shard in table.shards:      # every rank knows the slots: its results and checkpoints read them
                shard.with_slots(table.rule(model_optimizer).slots)
            if len(mine) == 1:
                look = mine[0]
                ids, payload = look.ids, _payload(_dense(grads[id(look)], look.rows), look.counts)
            else:
                ids, summed, counts = table_lib.merged([(look, grads[id(look)]) for look in mine])
                payload = _payload(summed, counts)
            if table.replicated:
                copied.append((table, ids, payload))
            elif mine[0].stand_in is not None:
                routed.append((table, ids, payload, len(mine) == 1))
            elif len(mine) == 1:            # the ids its reads sent: the server has them already
                for read in mine[0].reads:
                    part = payload if read.where is None else tf.gather(payload, read.where)
                    sent.append((read.shard, read.ids_on_server, part, [mine[0].rows.op], False))
            else:
                for shard, (part_ids, part) in zip(table.shards, table_lib.partition(ids, [payload],
                                                                                     len(table.shards))):
                    sent.append((shard, part_ids, part, [look.rows.op for look in mine], True))
        self._push(sent, moved)
        if routed:
            self._push_routed(routed, found, moved)
        if copied:
            self.replicated.build(copied, model_optimizer)
        if self.topo.is_chief and (sent or routed):
            self._boundaries(found, model_optimizer)

    def _push(self, sent, moved: list) -> None:
        """Per server, every payload into its shard's accumulator, in one message."""
        by_device: Dict[str, list] = {}
        for item in sent:
            by_device.setdefault(item[0].device, []).append(item)
        for device, items in sorted(by_device.items(), key=lambda kv: str(kv[0])):
            with tf.control_dependencies([op for item in items for op in item[3]]):
                flat = tf.concat([tf.reshape(item[2], [-1]) for item in items], 0)
            if self.topo.crosses_processes(device):
                moved.append(tensor_bytes(flat))
                moved.extend(tensor_bytes(item[1]) for item in items if item[4])
            with tf.device(device):
                widths = [int(item[2].shape[1]) for item in items]
                sizes = tf.stack([tf.size(item[1]) * width for item, width in zip(items, widths)])
                pieces = tf.split(flat, sizes, num=len(items))
                self.push_on[device] = tf.group(*[
                    _push(_accumulator(item[0], width, piece.dtype), item[1], tf.reshape(piece, [-1, width]))
                    for item, piece, width in zip(items, pieces, widths)])
            self.pushes.append(self.push_on[device])

    def _push_routed(self, routed, found, moved: list) -> None:
        """One compiled push per server for every routed table, its payload spread in one op; its
        ids the reads' messages when every routed table was read by one lookup, in their order."""
        topo = self.topo
        on_read_messages = all(single for _, _, _, single in routed)
        if on_read_messages:                # the entries in the reads' order, their ids the lookups'
            at = {id(look.table): k for k, look in enumerate(
                look for look in found if look.stand_in is not None and not look.table.replicated)}
            routed = sorted(routed, key=lambda item: at[id(item[0])])
        route = routes.Route([table.shards for table, _, _, _ in routed])
        ids = [item[1] for item in routed]
        flats = route.spread(ids, [item[2] for item in routed])
        messages = self.read_messages if on_read_messages else route.messages(ids)
        for device in route.devices:
            shards = route.shards_on(device)
            if topo.crosses_processes(device):
                moved.append(tensor_bytes(flats[device]))
                if not on_read_messages:
                    moved.append(tensor_bytes(messages[device]))
            with tf.device(device):
                self.routed_push[device] = compiled.push(shards, messages[device], flats[device], topo.rank, topo.size)
            self.fused[device] = shards
            self.pushes.append(self.routed_push[device])

    def _boundaries(self, found, model_optimizer) -> None:
        """Rank 0: every shard takes every rank's push and ends the step (one compiled op per
        server where its shards are compiled); per server, one group of them and one tensor of
        counters. Each waits for this rank's own push there only (a wait on every push would
        cross servers)."""
        size = self.topo.size
        trained = [table for table in table_lib.tables(found[0].rows.graph)
                   if not table.replicated and any(look.table is table for look in found)]
        rules = {table.name: table.rule(model_optimizer) for table in trained}
        fused = {}
        for device, shards in self.fused.items():
            with tf.device(device), tf.control_dependencies([self.routed_push[device]]):
                fused[device] = compiled.boundary_many(shards, [rules[shard.name] for shard in shards], size)
        compiled_shards = {id(shard) for shards in self.fused.values() for shard in shards}
        ended_on: Dict[str, list] = {}
        for table in trained:
            boundaries = [fused[shard.device] if id(shard) in compiled_shards else
                          self._taken_boundary(shard, rules[table.name]) for shard in table.shards]
            ended = table.end_step(boundaries)
            for shard in table.shards:
                ended_on.setdefault(shard.device, []).append(ended)
        for device in sorted(ended_on, key=str):
            others = [shard for table in trained for shard in table.shards
                      if shard.device == device and id(shard) not in compiled_shards]
            with tf.device(device):
                self.boundaries.append(tf.group(*ended_on[device]))
                with tf.control_dependencies(ended_on[device]):    # the compiled push's shards in one op
                    counted = [(shards, count(shards)) for shards, count in (
                        (self.fused.get(device, []), compiled.counters_many),
                        (others, lambda s: tf.stack([shard.counters() for shard in s]))) if shards]
            for shards, packed in counted:
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
        return bool(self.pushes) or self.replicated is not None

    @property
    def _tokens(self) -> bool:
        """Whether a server ends the step in standard ops, whose reads do not wait for it."""
        return bool(self.push_on)

    def targets(self) -> list:
        """What this rank's step adds: rank 0, the boundaries (and then every other rank's
        token); another rank, its pushes (and the wait for its token); every rank, its copies'
        boundaries."""
        copies = self.replicated.ended if self.replicated is not None else []
        return self._server_targets() + copies

    def _server_targets(self) -> list:
        topo = self.topo
        if not self.pushes:
            return []
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


def _pack_reads(reads: List["table_lib.ShardRead"], remote) -> list:
    """Rewires the shard reads of each server (and dtype) into one message of ids and one of
    rows; sets every read's ids_on_server. Returns the bytes that cross, per message."""
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
