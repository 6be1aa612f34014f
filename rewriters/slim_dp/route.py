"""The significant route (Slim-DP): a local replica on every rank, a global copy on the PS, and
every `period` steps a round that synchronises only the significant + explored coordinates.

Every rank trains its replica with the model's own train op on its own gradient and adds that
gradient to an accumulator. A round, for each piece of a variable's flattened global copy:
  1. every rank pushes its accumulated gradient at the selected coordinates: the core set
     (the most significant coordinates, |w| + lambda |last aggregated update|, chosen on the PS
     and refreshed every `refresh` rounds) plus an explored set drawn from the round number and
     a seed every rank shares, so only values cross the network, never indices;
  2. rank 0 takes the sum once all have pushed, and on the PS applies a copy of the model's
     optimizer (slots next to the global copy) to the mean, as a dense update whose gradient is
     zero at the coordinates not selected, then hands every other rank a token;
  3. every rank pulls the new global values of those coordinates into its replica and clears
     what it sent from its accumulator (all of it without --slim_error_feedback).
The other coordinates keep evolving locally. A round's pieces on one PS task travel together:
one push and one pull per task (_Packet). Core 1, explore 0, period 1 is synchronous data
parallelism: the global copy takes exactly the step single-device training takes.
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Dict, List

import tensorflow as tf

from parallax_tf import training_graph
from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.compat import tf_keras as keras_shim
from parallax_tf.errors import ModelError
from parallax_tf.strategy import BuildRequest
from rewriters.shared.pipeline import RouteState, SyncRoute
from rewriters.shared.rebuild import Rebuilt
from rewriters.slim_dp.options import SlimOptions


@dataclasses.dataclass
class _Unit:
    """One piece of a variable's global copy: elements [start, end) of the flattened variable."""
    name: str
    replica: object           # the rank's local variable (the model's)
    grad: tf.Tensor           # this rank's raw gradient of it
    optimizer: object
    start: int
    end: int
    server: int
    core_size: int
    explore_size: int
    seed: int

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def chosen(self) -> int:
        return self.core_size + self.explore_size


@dataclasses.dataclass
class _Packet:
    """The units of one PS task and dtype: a round moves their values in one tensor each way, one
    transfer per direction instead of one per unit (cnn, 2 ranks: 9 instead of 40 per step; on
    the 8-host rig the speed did not change measurably, 396 vs 399 examples/s)."""
    server: int
    members: list             # [(unit, its variables)]
    accumulator: object       # the ranks' pushes of a round, summed

    @property
    def sizes(self) -> List[int]:
        return [unit.chosen for unit, _ in self.members]


class SignificantRoute(SyncRoute):
    def __init__(self, request: BuildRequest, rebuilt: Rebuilt, entries):
        self.request, self.rebuilt, self.entries = request, rebuilt, entries
        self.topo = request.topology
        self.bytes, self.lower_bound = {}, []
        options = SlimOptions(**request.plan.options)
        self.period, self.refresh = options.period, options.refresh
        self.lam, self.error_feedback = options.update_weight, options.error_feedback
        self.units: List[_Unit] = []
        self.parts, self.working_copies, self.optimizers = {}, set(), []
        applied = rebuilt.training.applied()
        for entry in entries:
            pieces, grads = rebuilt.parts[entry.name], rebuilt.grads[entry.name]
            if len(pieces) != 1:
                raise ModelError(f"slim_dp: variable {entry.name!r} is partitioned by the model; create it "
                                 "without a partitioner (the strategy splits its global copy itself)")
            replica, grad = pieces[0].variable, grads[0]
            if grad is None or replica.op.name not in applied:
                raise ModelError(f"slim_dp: the train op does not update {entry.name!r}; mark it "
                                 "trainable=False or update it")
            for index, shard in enumerate(entry.shards):
                core, explore = selection_sizes(shard.row_end - shard.row_start, options.core, options.explore)
                self.units.append(_Unit(shard.name, replica, grad, applied[replica.op.name][2].optimizer,
                                        shard.row_start, shard.row_end, shard.server, core, explore,
                                        unit_seed(request.seed, entry.name, index)))

    def build(self) -> Dict[str, tf.Tensor]:
        """The model's transform reads this rank's own gradient: replicas train locally."""
        return {u.replica.op.name: u.grad for u in self.units}

    def after_step(self, step_targets: list) -> list:
        """Builds the accumulators, the global copies and the rounds; returns what every step
        must also run (adding the step's gradient to the accumulators)."""
        from parallax_tf import ops as ptf_ops
        ptf_ops.load()     # every process running the ops (PS servers live in the ranks) loads them
        topo = self.topo
        self.round = tf.compat.v1.placeholder_with_default(tf.constant(-1, tf.int64), [], name="parallax_round")
        self.round_bytes = tf.compat.v1.placeholder_with_default(tf.constant(0, tf.int64), [],
                                                                  name="parallax_round_bytes")
        self.bytes["significant"] = self.round_bytes
        self.lower_bound.append(self.round_bytes)
        accumulate, state = [], []
        for unit in self.units:
            state.append(self._variables(unit))
            flat = tf.reshape(unit.grad, [-1])[unit.start:unit.end]
            accumulate.append(state[-1]["sum"].assign_add(flat, read_value=False))
        packets = self._packets(state)
        with tf.control_dependencies(step_targets + accumulate):
            for unit, s in zip(self.units, state):
                s["selection"] = self._selection(unit, s["core_local"])
            pushes = [self._push(packet) for packet in packets]
        applied, refreshed = self._apply(state, packets, pushes)    # built everywhere, run by rank 0
        if topo.is_chief:
            plain, with_refresh = self._release(applied), self._release(refreshed)
        else:
            with tf.control_dependencies(pushes):
                queue = self._token_queue(topo.rank)
                with tf.device(queue.queue_ref.device):
                    token = queue.dequeue().op
            plain = with_refresh = token
        settled = applied if topo.is_chief else plain    # the global copies hold this round's update
        with tf.control_dependencies([settled]):
            pulls = [self._pull(packet) for packet in packets]
        core_updates = []
        with tf.control_dependencies(pulls + [with_refresh]):
            for s in state:
                core_updates.append(s["core_local"].assign(s["next_core"].read_value(), read_value=False))
        # the release of the other kind must not run: one token per rank per round
        self._targets = {False: [plain] + pulls, True: [with_refresh] + pulls + core_updates}
        self._byte_counts = self._count_bytes()
        self._state = state
        return accumulate

    # ---- pieces of a round -------------------------------------------------------------------
    def _variables(self, unit: _Unit) -> dict:
        dtype = unit.replica.dtype.base_dtype
        ps = f"/job:ps/task:{unit.server}"
        made = {}
        with tf.device(ps):
            made["global"] = tf.Variable(tf.zeros([unit.size], dtype), trainable=False, name=unit.name,
                                         use_resource=True)
            made["update"] = tf.Variable(tf.zeros([unit.size], dtype), trainable=False,
                                         name=unit.name + "_last_update", use_resource=True)
            made["core"] = tf.Variable(tf.zeros([unit.core_size], tf.int32), trainable=False,
                                       name=unit.name + "_core", use_resource=True)
            made["next_core"] = tf.Variable(tf.zeros([unit.core_size], tf.int32), trainable=False,
                                            name=unit.name + "_next_core", use_resource=True)
            if unit.chosen:
                # the round's coordinates, chosen once on the PS by rank 0's apply; pulls read them
                made["selected"] = tf.Variable(tf.zeros([unit.chosen], tf.int32), trainable=False,
                                               name=unit.name + "_selected", use_resource=True)
        with tf.device(self.topo.worker_device):
            made["sum"] = tf.Variable(tf.zeros([unit.size], dtype), trainable=False,
                                      name=unit.name + "_local_sum", use_resource=True)
            made["core_local"] = tf.Variable(tf.zeros([unit.core_size], tf.int32), trainable=False,
                                             name=unit.name + "_local_core", use_resource=True)
        self.parts.setdefault(unit.name.split("/parallax_global/")[0], []).append((unit, made["global"]))
        self.working_copies.update(v.name for k, v in made.items() if k != "global")
        return made

    def _packets(self, state: List[dict]) -> List[_Packet]:
        """The synchronised units grouped by PS task and dtype, in a fixed order on every rank."""
        grouped: Dict[tuple, list] = {}
        for unit, s in zip(self.units, state):
            if unit.chosen:
                grouped.setdefault((unit.server, unit.replica.dtype.base_dtype), []).append((unit, s))
        packets = []
        for (server, dtype), members in grouped.items():
            first = members[0][0].name
            with tf.device(f"/job:ps/task:{server}"):
                accumulator = tf.compat.v1.ConditionalAccumulator(
                    dtype, shape=[sum(unit.chosen for unit, _ in members)],
                    shared_name=first + "/parallax_round_grad", name=first.replace("/", "_") + "_round_grad",
                    reduction_type="SUM")
            packets.append(_Packet(server, members, accumulator))
        return packets

    def _selection(self, unit: _Unit, core_variable) -> tf.Tensor:
        """Core set plus this round's explored set, ascending: the same on every rank and the PS."""
        from parallax_tf import ops as ptf_ops
        return ptf_ops.round_selection(core_variable.read_value(), unit.size, unit.seed, self.round,
                                       unit.explore_size)

    def _push(self, packet: _Packet) -> tf.Operation:
        with tf.device(self.topo.worker_device):
            # a read and gather, not sparse_read: that would make the accumulator copy-on-read,
            # and every step's assign_add would then copy it whole
            values = tf.concat([tf.gather(s["sum"].read_value(), s["selection"]) for _, s in packet.members], 0)
        with tf.device(packet.accumulator.accumulator_ref.device):
            return packet.accumulator.apply_grad(values, local_step=self.round)

    def _apply(self, state: List[dict], packets: List[_Packet], pushes):
        """Rank 0: the mean of the pushes, applied on the PS by a copy of the model's optimizer;
        the last aggregated update remembered for the next core set. Returns (the applies, the
        applies followed by a core refresh). Built on every rank, so every rank's graph knows
        the global copies' slots; only rank 0 runs it."""
        from parallax_tf import ops as ptf_ops
        size = self.topo.size
        by_optimizer, remember = {}, []
        with tf.control_dependencies(pushes):
            for packet in packets:
                with tf.device(f"/job:ps/task:{packet.server}"):     # every member's server
                    total = packet.accumulator.take_grad(size)
                    means = tf.split(total / tf.cast(size, total.dtype), packet.sizes)
                    for (unit, s), mean in zip(packet.members, means):
                        # Every rank has pushed this round, so every rank has pulled the last one:
                        # the core set of a refresh becomes the one the PS selects with.
                        with tf.control_dependencies([mean]):
                            current = s["core"].assign(s["next_core"].read_value(), read_value=False)
                        with tf.control_dependencies([current]):
                            sel = self._selection(unit, s["core"])
                        remember.append(ptf_ops.flat_scatter_update(s["update"], sel, mean))
                        remember.append(s["selected"].assign(sel, read_value=False))
                        # Dense, not IndexedSlices: the optimizer must also move the coordinates
                        # the round did not select (momentum, Adam's moments), as synchronous
                        # training does where a gradient is zero. A sparse apply froze them: the
                        # global copy trailed the replicas (cnn with label noise, 2 hosts, 100
                        # steps: held-out loss 1.420 sparse, 1.182 dense, hybrid 1.177).
                        dense = tf.scatter_nd(tf.expand_dims(sel, 1), mean, [unit.size])
                        by_optimizer.setdefault(id(unit.optimizer), (unit.optimizer, []))[1].append(
                            (dense, s["global"]))
        applies = []
        for optimizer, pairs in by_optimizer.values():
            clone = _clone(optimizer)
            applies.append(clone.apply_gradients(pairs))
            self.optimizers.append((clone, [v for _, v in pairs]))
        done = tf.group(*applies, *remember)
        refreshes = []
        with tf.control_dependencies([done]):
            for unit, s in zip(self.units, state):
                with tf.device(f"/job:ps/task:{unit.server}"):
                    core, _ = ptf_ops.significance_select(s["global"].read_value(), s["update"].read_value(),
                                                          self.lam, unit.seed, self.round, unit.core_size, 0)
                    refreshes.append(s["next_core"].assign(core, read_value=False))
        return done, tf.group(done, *refreshes)

    def _pull(self, packet: _Packet) -> tf.Operation:
        """The new global values of this round's coordinates into the replicas; the sent part of
        the accumulated gradients (all of it without error feedback) cleared."""
        from parallax_tf import ops as ptf_ops
        with tf.device(f"/job:ps/task:{packet.server}"):
            # the PS's own record of the round's coordinates: no indices cross the network. A read
            # and gather, not sparse_read, which would switch the global copy to copy-on-read
            # and make every dense apply copy it.
            values = tf.concat([tf.gather(s["global"].read_value(), s["selected"].read_value())
                                for _, s in packet.members], 0)
        writes = []
        with tf.device(self.topo.worker_device):
            for (unit, s), part in zip(packet.members, tf.split(values, packet.sizes)):
                writes.append(ptf_ops.flat_scatter_update(unit.replica, s["selection"] + unit.start, part))
                if self.error_feedback:
                    writes.append(ptf_ops.flat_scatter_update(s["sum"], s["selection"], tf.zeros_like(part)))
                else:
                    writes.append(s["sum"].assign(tf.zeros([unit.size], part.dtype), read_value=False))
        return tf.group(*writes)

    def _release(self, after) -> tf.Operation:
        tokens = []
        with tf.control_dependencies([after]):
            for rank in range(1, self.topo.size):
                queue = self._token_queue(rank)
                with tf.device(queue.queue_ref.device):
                    tokens.append(queue.enqueue(tf.constant(0.0, tf.float64)))
        return tf.group(after, *tokens)

    def _token_queue(self, rank: int):
        with tf.device(f"/job:ps/task:{self.topo.host_of(rank)}"):
            return tf.queue.FIFOQueue(4, [tf.float64], shapes=[[]], shared_name=f"parallax_round_token_{rank}",
                                      name=f"parallax_round_token_{rank}")

    # ---- start, schedule, bytes -------------------------------------------------------------
    def _initial_copy(self, state: List[dict]) -> tf.Operation:
        """Every rank, after rank 0 loaded the global copies: replicas and their optimizer slots
        start from the global values, and every rank computes the first core set (on the PS,
        from the same values, so all agree)."""
        from parallax_tf import ops as ptf_ops
        assigns, by_replica = [], {}
        for unit, s in zip(self.units, state):
            by_replica.setdefault(unit.replica.name, []).append((unit, s))
            with tf.device(f"/job:ps/task:{unit.server}"):
                core, _ = ptf_ops.significance_select(s["global"].read_value(), s["update"].read_value(),
                                                      self.lam, unit.seed, 0, unit.core_size, 0)
            assigns.append(s["core_local"].assign(core, read_value=False))
            if self.topo.is_chief:
                assigns += [s["core"].assign(core, read_value=False), s["next_core"].assign(core, read_value=False)]
        clone_of = {v.name: c for c, variables in self.optimizers for v in variables}
        for pieces in by_replica.values():
            replica, optimizer = pieces[0][0].replica, pieces[0][0].optimizer
            self.working_copies.add(replica.name)
            assigns.append(replica.assign(_whole([s["global"] for _, s in pieces], replica), read_value=False))
            for slot_name in optimizer.get_slot_names():
                local = optimizer.get_slot(replica, slot_name)
                if local is None:
                    continue
                self.working_copies.add(local.name)
                clone = clone_of.get(pieces[0][1]["global"].name)
                found = [clone.get_slot(s["global"], slot_name) for _, s in pieces] if clone else []
                if found and all(g is not None for g in found):
                    assigns.append(local.assign(_whole(found, replica), read_value=False))
        return tf.group(*assigns)

    def finish(self, broadcast) -> RouteState:
        from parallax_tf.values import Part
        # after the broadcast of the other replicated variables, which would overwrite these
        with tf.control_dependencies([broadcast] if broadcast is not None else []):
            start = self._initial_copy(self._state)
        parts = {name: [Part(var, unit.start, unit.end) for unit, var in pieces] for name, pieces in self.parts.items()}
        return RouteState(broadcast=start, parts=parts, working_copies=set(self.working_copies),
                          optimizers=list(self.optimizers), scheduled=self.schedule)

    def schedule(self, step: int):
        """After step `step` (0-based) of every `period`: round (step + 1) / period - 1."""
        if (step + 1) % self.period:
            return [], {}
        index = (step + 1) // self.period - 1
        refresh = (index + 1) % self.refresh == 0
        return self._targets[refresh], {self.round: index, self.round_bytes: self._byte_counts[refresh]}

    def _count_bytes(self) -> Dict[bool, int]:
        """What this rank moves in a round (values pushed and pulled; a refresh's core set pulled
        by the other ranks), counted where a server in another process is involved."""
        plain = refresh = 0
        for unit in self.units:
            if unit.server == self.topo.host and self.topo.local_rank == 0:
                continue
            moved = 2 * unit.chosen * unit.replica.dtype.base_dtype.size
            plain += moved
            refresh += moved + (4 * unit.core_size if not self.topo.is_chief else 0)
        return {False: plain, True: refresh}


def selection_sizes(size: int, core: float, explore: float):
    """(core set size, explored set size) of a piece of `size` elements."""
    core_size = int(round(core * size))
    return core_size, min(size - core_size, int(round(explore * size)))


def unit_seed(seed: int, name: str, index: int) -> int:
    """The explored sets' seed of piece `index` of variable `name`: the same on every rank."""
    return zlib.crc32(f"{seed}/{name}/{index}".encode()) & 0x7FFFFFFF


def _clone(optimizer):
    """A second instance of the model's optimizer (same hyper-parameters, own slots and
    non-slot state) for the global copies."""
    if training_graph.is_legacy_keras_optimizer(optimizer):
        # get_config/from_config would read the hyper-parameters in a session of tf_keras' own
        return keras_shim.fresh_legacy_copy(optimizer)
    if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise ModelError(f"slim_dp applies the model's optimizer to the global copy and needs a "
                         f"tf.compat.v1.train.Optimizer; got {type(optimizer).__name__}")
    return tf_shim.fresh_copy(optimizer)


def _whole(pieces, like) -> tf.Tensor:
    """The flat pieces of a global copy (read on their servers) as one value shaped like `like`."""
    return tf.reshape(tf.concat([p.read_value() for p in pieces], 0), like.shape)
