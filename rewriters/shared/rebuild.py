"""What every rewriter shares: rebuild model_fn under the plan's placement and take this rank's
own gradients."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, List

import tensorflow as tf

from parallax_tf import dynamic
from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.errors import ModelError
from parallax_tf.graph_walk import VARIABLE_OPS, ancestors
from parallax_tf.inspect_graph import logical_name
from parallax_tf.plan import (DYNAMIC_ON_SERVERS, DYNAMIC_REPLICATED, ROUTE_ALLTOALL, ROUTE_PS, TOOLKIT_GLOBAL_STEP,
                             Plan)
from parallax_tf.strategy import BuildRequest
from parallax_tf.values import Part
from rewriters.shared.alltoall_lookup import exchange_lookups, shard_rows
from rewriters.shared.transform import rewire


@dataclasses.dataclass
class DistinctLookup:
    gather: tf.Operation    # the gather of distinct rows, which the placer runs on the variable's server
    ids: tf.Tensor          # the distinct ids (int64) it reads, on the worker
    position: tf.Tensor     # per looked-up id, its index in `ids`


@dataclasses.dataclass
class Rebuilt:
    training: object                            # training_record.Training of this rank's graph
    parts: Dict[str, List[Part]]                # logical name -> its pieces (trainable variables)
    grads: Dict[str, list]                      # logical name -> this rank's own raw gradient per part
                                                # (None where the train op does not update it)
    # variable op name -> its one de-duplicated lookup, for a part whose gradient comes from it alone
    distinct_lookups: Dict[str, "DistinctLookup"] = dataclasses.field(default_factory=dict)
    # alltoall-route variable op name -> (a lookup's alltoall_lookup.Lookup, its gradient rows), per lookup
    exchanged: Dict[str, list] = dataclasses.field(default_factory=dict)
    packs: list = dataclasses.field(default_factory=list)     # the alltoall route's exchanges (one per dtype)

    @property
    def loss(self):
        return self.training.loss

    def require_a_gradient(self) -> None:
        """A step that would train nothing is the user's mistake: one clear message."""
        if all(g is None for grads in self.grads.values() for g in grads):
            raise ModelError("no trainable variable gets a gradient from the loss: check that the loss "
                             "depends on the model's variables")


def rebuild(request: BuildRequest, on_servers=None, step_on_server: bool = False, distinct_pulls: bool = False) -> Rebuilt:
    """Calls model_fn (and, for the optimizer form, minimize) in the current default graph with
    variables placed as the plan says: the shards of `on_servers` (default: the PS route's
    variables) and their optimizer slots on their server (TF's partitioner splits variables the
    plan shards), the global step on PS 0 when there are such variables or `step_on_server`,
    everything else (model state, optimizers' other state, all ops) on this rank's worker; an
    alltoall-route variable as this rank's shard of it.
    Then takes this rank's own raw gradients for every variable the train op updates."""
    plan = request.plan
    on_servers = plan.on_route(ROUTE_PS) if on_servers is None else on_servers
    on_ranks = {v.name: v for v in plan.on_route(ROUTE_ALLTOALL)}
    # a dynamic table's shards: one per host's parameter server (--partitions: that many, in turn),
    # or one on this rank's worker for a table replicated on the ranks
    on_servers_tables = [t for t in plan.dynamic_tables if t.route == DYNAMIC_ON_SERVERS]
    shards = on_servers_tables[0].shards if on_servers_tables else plan.num_hosts
    replicated = [t.name for t in plan.dynamic_tables if t.route == DYNAMIC_REPLICATED]
    with dynamic.sharded_over([f"/job:ps/task:{k % plan.num_hosts}" for k in range(shards)], deferred=True,
                              replicated=replicated, own_device=request.topology.worker_device):
        training = _build_placed(request, on_servers, on_ranks, step_on_server)
    parts = _parts_by_logical_name(plan)
    trained = {v.name for v in plan.trained}
    missing, extra = trained - set(parts), set(parts) - trained
    if missing or extra:
        raise ModelError(f"model_fn built different variables the second time (missing {sorted(missing)}, "
                         f"new {sorted(extra)}); model_fn must build the same graph every call")
    sparse_on_ps = {v.name for v in on_servers if v.gradient == "sparse"}
    with tf.device(request.topology.worker_device):
        return _own_rows_and_gradients(request, training, parts, sparse_on_ps if distinct_pulls else set(),
                                       sparse_on_ps, on_ranks)


def _build_placed(request: BuildRequest, on_servers, on_ranks: dict, step_on_server: bool):
    """model_fn's training graph with its variables where the plan puts them (rebuild)."""
    plan, topo = request.plan, request.topology
    graph = tf.compat.v1.get_default_graph()
    ps_device = {s.name: f"/job:ps/task:{s.server}" for v in on_servers for s in v.shards}
    if (on_servers or step_on_server) and plan.global_step:
        ps_device[plan.global_step] = "/job:ps/task:0"   # one global step, read and advanced by all
    auto_parts = {v.name: v.partitions for v in on_servers if v.partitions > 1 and not v.user_partitioned}
    row_splits = {v.name: [s.row_end - s.row_start for s in v.shards] for v in on_servers if v.name in auto_parts}
    slot_prefixes = tuple(f"{name}/" for name in ps_device)

    def place(op):
        if op.type in VARIABLE_OPS and op.name in ps_device:
            return ps_device[op.name]
        return op.device or topo.worker_device

    def getter(getter, name, *args, **kwargs):  # TF passes the next getter as `getter`
        kwargs["use_resource"] = True
        if name in auto_parts:
            kwargs["partitioner"] = tf.compat.v1.fixed_size_partitioner(auto_parts[name])
        return getter(name, *args, **kwargs)

    def create_variable(next_creator, kwargs, in_apply: bool):
        kwargs["use_resource"] = True   # reads of PS variables then run on the PS (only rows move)
        name = kwargs.get("name") or ""
        entry = on_ranks.get(_created_name(graph, name))
        if entry is not None and not in_apply:
            rank_shard(kwargs, entry, topo.size, topo.rank)
        if in_apply and name.startswith(slot_prefixes):
            return next_creator(**kwargs)     # a PS variable's slot lives next to it
        # Optimizers colocate their other state (Adam's beta powers) with some variable, and an
        # EMA its shadows with theirs: such state is kept on every rank instead, so no rank
        # reads a value another rank is about to change.
        with tf.compat.v1.colocate_with(None, ignore_existing=True):
            return next_creator(**kwargs)

    tf.compat.v1.set_random_seed(request.seed)
    with contextlib.ExitStack() as stack:
        stack.enter_context(graph.device(place))  # a device function: tf.device takes only strings
        stack.enter_context(tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(), custom_getter=getter))
        return request.front_end.build(request.ctx, variable_hook=create_variable, shard=request.shard_input,
                                       input_decisions=request.plan.inputs, row_splits=row_splits)


def _own_rows_and_gradients(request, training, parts, pulled: set, sparse_on_ps: set, on_ranks: dict) -> Rebuilt:
    """Lookups of `pulled` PS variables read distinct rows, those of alltoall-route variables go
    through the exchange; then this rank's own gradients (rebuild)."""
    topo = request.topology
    forward = ancestors(training.loss.op)
    expansions, distinct_lookups = {}, {}
    for name in sorted(pulled):
        for part in parts[name]:
            expansions.update(pull_distinct_rows(part.variable, forward))
    shards = [part.variable for name in sorted(on_ranks) for part in parts[name]]
    exchanges, packs = exchange_lookups(shards, forward, topo.size, topo.rank) if shards else ({}, [])
    expansions.update(exchanges)
    exchanged = {var.op.name: [] for var in shards}
    grads = own_gradients(training, parts, sparse_on_ps | set(on_ranks), expansions, distinct_lookups, exchanged)
    return Rebuilt(training=training, parts=parts, grads=grads, distinct_lookups=distinct_lookups,
                   exchanged=exchanged, packs=packs)


def _created_name(graph, name) -> str:
    """The op name a variable created with `name` gets: get_variable passes its full name, a
    tf.Variable (a Keras layer's weight) is named inside the current name scope."""
    return graph.unique_name(name.rstrip("/"), mark_as_used=False) if name else ""


def rank_shard(kwargs: dict, entry, num_ranks: int, rank: int) -> None:
    """Creates this rank's shard of an alltoall-route variable instead of the whole variable: its
    rows, starting as zeros (every rank's shard then gets its rows of the single-device initial
    value, values.StateIO)."""
    shape = [shard_rows(entry.shape[0], num_ranks, rank)] + list(entry.shape[1:])
    dtype = tf.as_dtype(entry.dtype)
    kwargs["initial_value"] = lambda: tf.zeros(shape, dtype)
    kwargs["dtype"] = dtype
    if "shape" in kwargs:
        kwargs["shape"] = shape


def pull_distinct_rows(variable, needed: set) -> dict:
    """Each lookup of a PS variable (a gather the placer runs next to the variable) reads every
    distinct id once: the ids are de-duplicated on the worker, only their rows cross, and the
    worker expands them back to the lookup's shape. Called in the worker's device scope, before
    gradients are taken. Returns new gather -> (its expansion, the lookup's ids, DistinctLookup):
    the gradient is still taken per looked-up id, as single-device TF does (a gradient transform
    such as a global norm sees the same rows)."""
    expansions = {}
    for op in list(variable.handle.consumers()):
        if op.type != "ResourceGather" or op.get_attr("batch_dims") != 0 or op not in needed:
            continue
        ids, looked_up = op.inputs[1], op.outputs[0]
        distinct, position = tf.unique(tf.reshape(ids, [-1]))
        distinct = tf.cast(distinct, tf.int64)      # as a push's indices must be: the same tensor serves both
        rows = tf_shim.resource_gather(variable.handle, distinct, dtype=looked_up.dtype, name=op.name + "_distinct")
        row_shape = tf.shape(rows)[1:]
        expanded = tf.reshape(tf.gather(rows, position), tf.concat([tf.shape(ids), row_shape], 0))
        expanded.set_shape(looked_up.shape)
        rewire(looked_up, expanded, set(looked_up.consumers()))
        expansions[rows.op] = (expanded, ids, DistinctLookup(rows.op, distinct, position))
    return expansions


def own_gradients(training, parts: Dict[str, List[Part]], sparse_on_ps, expansions=None,
                  distinct_lookups=None, exchanged=None) -> Dict[str, list]:
    """This rank's raw gradient for every part the train op updates, of the same loss the user
    differentiated (one tf.gradients per distinct gradient call)."""
    raw = training.raw_gradients()
    applied = training.applied()
    by_call: Dict[int, tuple] = {}
    for name, pieces in parts.items():
        for part in pieces:
            key = part.variable.op.name
            if key in applied:
                call = raw[key][1]
                by_call.setdefault(id(call), (call, {}))[1].setdefault(name, []).append(part)
    grads = {name: [None] * len(pieces) for name, pieces in parts.items()}
    for call, subset in by_call.values():
        found = gradients(call.ys, call.grad_ys, subset, sparse_on_ps, expansions, distinct_lookups, exchanged)
        for name, part_grads in found.items():
            for part, grad in zip(subset[name], part_grads):
                grads[name][parts[name].index(part)] = grad
    return grads


def gradients(ys, grad_ys, parts: Dict[str, List[Part]], sparse_on_ps, expansions=None,
              distinct_lookups=None, exchanged=None) -> Dict[str, list]:
    """Gradient per part. For a sparse variable on a PS, it is built here (on the worker) from
    the gradient of each lookup's output, as TF's own ResourceGather gradient does: TF would
    colocate those ops with the variable, sending every looked-up row, repeats included, to
    the server and back before the de-duplicated push. `expansions` (pull_distinct_rows):
    for a de-duplicated lookup, the gradient of its expansion, per looked-up id; a PS part whose
    gradient comes from one such lookup alone is entered in `distinct_lookups`; the gradient rows
    of each lookup of an alltoall-route part go to `exchanged` with its Lookup."""
    needed = set().union(*(ancestors(y.op) for y in ys))
    xs, recipe = [], []                      # recipe: per part, ("var", i) or ("lookups", [(op, i)])
    for name, pieces in parts.items():
        for part in pieces:
            readers = [op for op in part.variable.handle.consumers() if op in needed]
            lookups = [op for op in readers if op.type == "ResourceGather" and op.get_attr("batch_dims") == 0]
            if name in sparse_on_ps and lookups and len(lookups) == len(readers):
                recipe.append(("lookups", [(op, len(xs) + k) for k, op in enumerate(lookups)]))
                xs.extend((expansions or {}).get(op, (op.outputs[0],))[0] for op in lookups)
            else:
                recipe.append(("var", len(xs)))
                xs.append(part.variable)
    dys = tf.gradients(ys, xs, grad_ys=grad_ys)
    flat = []
    for (kind, where), part in zip(recipe, [p for pieces in parts.values() for p in pieces]):
        if kind == "var":
            flat.append(dys[where])
            continue
        var = part.variable
        row_shape = var.shape[1:].as_list()
        pieces = [(tf.reshape(dys[i], [-1] + row_shape), tf.reshape((expansions or {}).get(op, (None, op.inputs[1]))[1], [-1]))
                  for op, i in where if dys[i] is not None]
        if not pieces:
            flat.append(None)
            continue
        if exchanged is not None and var.op.name in exchanged:
            exchanged[var.op.name] = [(expansions[op][2], tf.reshape(dys[i], [-1] + row_shape))
                                      for op, i in where if dys[i] is not None]
        elif len(where) == 1 and where[0][0] in (expansions or {}) and distinct_lookups is not None:
            distinct_lookups[var.op.name] = expansions[where[0][0]][2]
        values = tf.concat([v for v, _ in pieces], 0) if len(pieces) > 1 else pieces[0][0]
        indices = tf.concat([tf.cast(i, tf.int64) for _, i in pieces], 0) if len(pieces) > 1 else pieces[0][1]
        flat.append(tf.IndexedSlices(values, indices, tf.constant(var.shape.as_list(), tf.int64)))
    grads, i = {}, 0
    for name, pieces in parts.items():
        grads[name] = flat[i:i + len(pieces)]
        i += len(pieces)
    return grads


def _parts_by_logical_name(plan: Plan) -> Dict[str, List[Part]]:
    entries = plan.by_name()
    parts: Dict[str, List[Part]] = {}
    for var in tf.compat.v1.trainable_variables():
        parts.setdefault(logical_name(var), []).append(var)
    out = {}
    for name, variables in parts.items():
        entry = entries.get(name)
        by_name = {v.op.name: v for v in variables}
        if entry is not None and entry.shards and all(s.name in by_name for s in entry.shards):
            out[name] = [Part(by_name[s.name], s.row_start, s.row_end) for s in entry.shards]
        else:
            variables.sort(key=lambda v: v.op.name)
            start, pieces = 0, []
            for v in variables:
                rows = int(v.shape[0]) if v.shape.rank else 1
                pieces.append(Part(v, start, start + rows))
                start += rows
            out[name] = pieces
    return out


def advancing_global_step(training, device: str):
    """(train target, global step): the model's own step when its train op advances one, else
    the toolkit's own on `device`, advanced once after the train op."""
    step, target = training.global_step, training.train_op
    if step is None:
        with tf.device(device):
            step = tf.Variable(0, dtype=tf.int64, trainable=False, name=TOOLKIT_GLOBAL_STEP, use_resource=True)
        with tf.control_dependencies([target]), tf.compat.v1.colocate_with(step):
            target = step.assign_add(1).op
    return target, step
