"""Strategy `ps_plus` (PS+, IEEE TPDS 33(12), 2022): asynchronous parameter servers, eager pull,
staleness-scaled learning rate. Every variable is on route async_ps.

On the servers: the global copy of every variable (a dense one as `<name>/parallax_global`, a
sparse one is the model's own variable, placed there), the optimizer's slots beside it, and
per server task a version counter (task 0's is the global step). A push is one compiled
ParallaxStaleApply per task that holds variables: it reads the task's version, scales the
learning rate by the staleness of the pushing rank's copy, applies the model's optimizer
(SGD, Momentum or Adam) and advances the version, all under the variables' locks.

On each rank: a local copy of every dense variable (the model's own variable), which the step
reads; two pull buffers the background puller fills from the global copies (with the version
they were read at); and the outbox the step drops its update into. The step computes the
model's own gradient (after the model's own transform, e.g. clipping) on the local copy and
the rows of sparse variables it reads from their servers. The runner is
rewriters/ps_plus/runner.py.
"""
from __future__ import annotations

from typing import Dict, List

import tensorflow as tf

from parallax_tf import ops, training_graph
from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.errors import ModelError
from parallax_tf.graph_walk import WRITE_OPS, ancestors
from parallax_tf.inspect_graph import logical_name
from parallax_tf.plan import ROUTE_LOCAL, TOOLKIT_GLOBAL_STEP
from parallax_tf.runtime.barriers import ArrivalBarrier
from parallax_tf.strategy import BuildRequest, DistributedGraph
from parallax_tf.values import Part
from rewriters.ps_plus.options import PSPlusOptions
from rewriters.ps_plus.route import ROUTE_ASYNC_PS
from rewriters.ps_plus.runner import STALENESS_BUCKETS, AsyncRunner, AsyncSpec
from rewriters.shared import transform as transform_lib
from rewriters.shared.pipeline import check_routes, finish_graph, start_variables
from rewriters.shared.rebuild import rebuild
from rewriters.shared.step_report import tensor_bytes

_OPTIMIZERS = {tf.compat.v1.train.GradientDescentOptimizer: "sgd", tf.compat.v1.train.MomentumOptimizer: "momentum",
               tf.compat.v1.train.AdagradOptimizer: "adagrad", tf.compat.v1.train.AdamOptimizer: "adam"}


def rewrite(request: BuildRequest) -> DistributedGraph:
    ops.load()     # every process that runs the ops (the servers live in the ranks) loads them
    plan, topo = request.plan, request.topology
    check_routes(plan, {ROUTE_ASYNC_PS, ROUTE_LOCAL}, "ps_plus")
    entries = plan.on_route(ROUTE_ASYNC_PS)
    rows_read = [e for e in entries if e.params["pull"] == "rows"]
    rebuilt = rebuild(request, on_servers=rows_read, step_on_server=True)
    training = rebuilt.training
    apply = _one_supported_apply(training)
    optimizer = apply.optimizer
    kind = _OPTIMIZERS[type(optimizer)]
    global_step = training.global_step
    if global_step is None:
        with tf.device("/job:ps/task:0"):
            global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name=TOOLKIT_GLOBAL_STEP,
                                      use_resource=True)
    if global_step.dtype.base_dtype != tf.int64:
        raise ModelError(f"ps_plus counts pushes in the global step, which must be int64; {global_step.op.name} "
                         f"is {global_step.dtype.base_dtype.name} (use tf.compat.v1.train.get_or_create_global_step())")
    pushed = _own_transformed_gradients(training, rebuilt)
    options = PSPlusOptions(**plan.options)
    state = _ServerState(plan, rebuilt, optimizer, global_step)
    with tf.device(topo.worker_device):
        step_targets, outbox, outbox_layout = _outbox(state, pushed, training)
        push = _push(state, outbox, outbox_layout, optimizer, kind, options.rule())
        histogram = _count_staleness(push, topo)
        pulls, swaps, pull_bytes = _pull_buffers(state)
        step_bytes = tf.add_n([tensor_bytes(g) for g in pushed.values()]
                              + [tensor_bytes(t) for t in _rows_read(rebuilt, rows_read, training.loss)]
                              or [tf.constant(0, tf.int64)])
    with tf.device("/job:ps/task:0"), tf.compat.v1.colocate_with(None, ignore_existing=True):
        # one ticket per step, taken before it runs: the ranks together push exactly --steps times
        tickets = tf.Variable(global_step.initial_value, trainable=False, use_resource=True,
                              name="parallax_ps0/tickets")
        claim = tickets.assign_add(1)
    state.saved_as[tickets.name] = (logical_name(global_step), 10**6)
    barrier = ArrivalBarrier(topo.rank, topo.size, topo.server_ranks)
    start = start_variables()     # no broadcast: each rank's copies come from its pulls
    spec = AsyncSpec(claim=claim, step_targets=step_targets, step_bytes=step_bytes, push=push,
                     close_outbox=outbox.close(cancel_pending_enqueues=True),
                     global_version=global_step.read_value(), pulls=pulls, swaps=swaps,
                     pull_bytes=pull_bytes, max_staleness=options.max_staleness,
                     route=ROUTE_ASYNC_PS, histogram=histogram.read_value(),
                     task_versions={task: info["version"].read_value() for task, info in state.tasks.items()})
    return finish_graph(
        start, loss=training.loss, train_op=step_targets, global_step=global_step, parts=state.global_parts,
        runner=AsyncRunner(training.loss, spec, training.model.metrics), optimizers=[(state, state.slotted)],
        barrier=barrier, chief_init=[histogram.initializer], working_copies=state.working_copies,
        saved_as=state.saved_as, survivable_loss="ps_plus ranks never wait for each other; this one held no server state")


def _one_supported_apply(training):
    if len(training.applies) != 1:
        raise ModelError(f"ps_plus applies one optimizer per push; the train op runs {len(training.applies)} "
                         "apply_gradients calls. Use one optimizer over all variables")
    apply = training.applies[0]
    if type(apply.optimizer) not in _OPTIMIZERS:
        raise ModelError(f"ps_plus applies pushes with its compiled op, which implements tf.compat.v1.train "
                         f"GradientDescentOptimizer, MomentumOptimizer, AdagradOptimizer and AdamOptimizer; the model uses "
                         f"{training_graph.describe_optimizer(apply.optimizer)}. Switch optimizer (tf_keras' legacy "
                         "optimizers place epsilon and momentum differently) or use --strategy hybrid")
    return apply


def _own_transformed_gradients(training, rebuilt) -> Dict[str, object]:
    """Variable op name -> what its apply would consume: the model's transform (if any) of this
    rank's own gradient, the sparse ones de-duplicated as tf.compat.v1 optimizers do."""
    own = {p.variable.op.name: g for name, parts in rebuilt.parts.items()
           for p, g in zip(parts, rebuilt.grads[name]) if g is not None}
    needed = ancestors(training.train_op)
    transform = transform_lib.analyse(training, needed)
    transform_lib.feed_global_gradients(transform, own, needed)
    pushed = {}
    for var, grad in own.items():
        applied = transform.applied.get(var)
        if applied is None:
            continue
        if applied is not transform.raw.get(var):
            # the transform now reads this rank's own rows; a row-wise transform (clipping,
            # scaling) keeps them in the order of our indices, a densifying one gives a tensor
            grad = tf.IndexedSlices(applied.values, grad.indices, grad.dense_shape) \
                if isinstance(applied, tf.IndexedSlices) and isinstance(grad, tf.IndexedSlices) else applied
        if isinstance(grad, tf.IndexedSlices):
            unique, position = tf.unique(grad.indices)
            grad = tf.IndexedSlices(tf.math.unsorted_segment_sum(grad.values, position, tf.size(unique)), unique,
                                    grad.dense_shape)
        pushed[var] = grad
    return pushed


class _ServerState:
    """The global copies, their slots, the optimizer's powers and the versions, per server task;
    and how each maps to the single-device names of a checkpoint."""

    def __init__(self, plan, rebuilt, optimizer, global_step):
        self.optimizer = optimizer
        self.tasks: Dict[int, dict] = {}        # task -> {"vars": [(global, local or None)], "version": var}
        self.global_parts: Dict[str, List[Part]] = {}
        self.slots: Dict[str, Dict[str, tf.Variable]] = {}   # global var name -> slot name -> slot
        self.slotted: List[tf.Variable] = []
        self.working_copies, self.saved_as = set(), {}
        self.global_step = global_step
        entries = plan.by_name()
        local_slots = {}
        for name, parts in rebuilt.parts.items():
            entry = entries[name]
            for shard, part in zip(entry.shards, parts):
                local = part.variable
                if entry.params["pull"] == "rows":      # the model's variable is the global copy
                    self._add(shard.server, local, None, part, name)
                    self.slots[local.name] = {s: optimizer.get_slot(local, s) for s in optimizer.get_slot_names()}
                    continue
                with tf.device(f"/job:ps/task:{shard.server}"), tf.compat.v1.colocate_with(None, ignore_existing=True):
                    copy = tf.Variable(tf.zeros(local.shape, local.dtype.base_dtype), trainable=False,
                                       name=shard.name, use_resource=True)
                    self.slots[copy.name] = {}
                    for slot_name in optimizer.get_slot_names():
                        mine = optimizer.get_slot(local, slot_name)
                        suffix = mine.op.name[len(local.op.name) + 1:]
                        # the model slot's own start (Adagrad's accumulator is not zero): slots
                        # are not among the captured initial values
                        self.slots[copy.name][slot_name] = tf.Variable(
                            mine.initial_value, trainable=False, name=f"{shard.name}/{suffix}", use_resource=True)
                        local_slots[mine.name] = mine
                self.working_copies.add(local.name)
                self._add(shard.server, copy, local, Part(copy, part.row_start, part.row_end), name)
        self.working_copies |= set(local_slots)
        self._versions_and_powers()

    def _add(self, server, global_var, local_var, part, name):
        self.tasks.setdefault(server, {"vars": []})["vars"].append((global_var, local_var))
        self.global_parts.setdefault(name, []).append(part)
        self.slotted.append(global_var)

    def _versions_and_powers(self):
        """Task 0's version is the global step; every other task's is a copy of it (restored
        from the same checkpoint value). Adam's beta powers: one pair per task, all copies of
        the model's (advanced once per push on every task, so they stay equal)."""
        step_key = logical_name(self.global_step)
        powers = [p for p in self._non_slot_variables()]
        for task in sorted(self.tasks) + ([0] if 0 not in self.tasks else []):
            info = self.tasks.setdefault(task, {"vars": []})
            if task == 0:
                info["version"] = self.global_step
            else:
                with tf.device(f"/job:ps/task:{task}"), tf.compat.v1.colocate_with(None, ignore_existing=True):
                    info["version"] = tf.Variable(self.global_step.initial_value, name=f"parallax_ps{task}/version",
                                                  use_resource=True, trainable=False)
                self.saved_as[info["version"].name] = (step_key, task)
            info["powers"] = []
            for power in powers:
                with tf.device(f"/job:ps/task:{task}"), tf.compat.v1.colocate_with(None, ignore_existing=True):
                    copy = tf.Variable(power.initial_value, use_resource=True, trainable=False,
                                       name=f"parallax_ps{task}/{power.op.name}")
                info["powers"].append(copy)
                self.saved_as[copy.name] = (logical_name(power), task + 1)
        self.working_copies |= {p.name for p in powers}

    def _non_slot_variables(self):
        if not isinstance(self.optimizer, tf.compat.v1.train.AdamOptimizer):
            return []
        return tf_shim.beta_accumulators(self.optimizer)

    # what values.collect_state asks of an optimizer
    def get_slot_names(self):
        return self.optimizer.get_slot_names()

    def get_slot(self, var, name):
        return self.slots.get(var.name, {}).get(name)


def _outbox(state: _ServerState, pushed, training):
    """The per-step targets: the update (copy versions + gradients) into a queue of one on the
    worker, and the model-state updates the train op runs (batch-norm statistics)."""
    layout, tensors = [], []
    for task in sorted(state.tasks):
        info = state.tasks[task]
        dense = [local for _, local in info["vars"] if local is not None]
        if dense:   # the version the local copy of this task's dense variables was pulled at
            info["copy_version"] = tf.Variable(tf.zeros([], tf.int64), trainable=False, use_resource=True,
                                               name=f"parallax_copy_version/task_{task}")
            state.working_copies.add(info["copy_version"].name)
            tensors.append(info["copy_version"].read_value())
        else:       # only rows read in the step: their version is the task's version now
            with tf.device(info["version"].device):
                tensors.append(tf.identity(info["version"].read_value()))
        layout.append(("version", task, None))
        for global_var, local in info["vars"]:
            grad = pushed.get((local if local is not None else global_var).op.name)
            if grad is None:
                continue
            if isinstance(grad, tf.IndexedSlices):
                tensors.extend([grad.values, tf.cast(grad.indices, tf.int64)])
                layout.append(("sparse", task, global_var))
            else:
                tensors.append(grad)
                layout.append(("dense", task, global_var))
    outbox = tf.queue.FIFOQueue(1, [t.dtype for t in tensors], name="parallax_outbox")
    targets = [outbox.enqueue(tensors)]
    state_vars = {v.op.name for v in tf.compat.v1.global_variables() if not v.trainable}
    for op in ancestors(training.train_op):
        if op.type in WRITE_OPS and op.inputs and op.inputs[0].op.name in state_vars \
                and op.name not in training.created_by_optimizers() and op.inputs[0].op.name != state.global_step.op.name:
            targets.append(op)
    return targets, outbox, layout


def _push(state: _ServerState, outbox, layout, optimizer, kind: str, rule) -> dict:
    """One outbox entry applied on every task that holds variables; the global step advances
    once (task 0 is one of them, or advances alone)."""
    values = outbox.dequeue()
    values = values if isinstance(values, (list, tuple)) else [values]
    lr, hyper = _hyper_values(optimizer, kind)
    by_task: Dict[int, dict] = {}
    i = 0
    for what, task, var in layout:
        item = by_task.setdefault(task, {"vars": [], "grads": [], "indices": []})
        if what == "version":
            item["copy_version"] = values[i]
            i += 1
        elif what == "dense":
            item["vars"].append(var), item["grads"].append(values[i]), item["indices"].append(None)
            i += 1
        else:
            item["vars"].append(var), item["grads"].append(values[i]), item["indices"].append(values[i + 1])
            i += 2
    staleness, version, applied = None, None, []
    for task, item in sorted(by_task.items()):
        info = state.tasks[task]
        with tf.device(f"/job:ps/task:{task}"):
            if item["vars"]:
                slots = [state.get_slot(v, s) for v in item["vars"] for s in optimizer.get_slot_names()]
                tau, after = ops.stale_apply(info["version"], item["copy_version"], lr, item["vars"], slots,
                                             info["powers"], item["grads"], item["indices"], kind,
                                             rule=rule[0], gamma=rule[1], **hyper)
            else:
                after = info["version"].assign_add(1)
                tau = after - 1 - item["copy_version"]
        applied.append(after)
        if task == 0:
            staleness, version = tau, after
    # every task's apply is a target: only task 0's answer is read
    return {"staleness": staleness, "version": version, "applied": tf.group(*applied)}


def _count_staleness(push: dict, topo):
    """Pushes by rank and staleness, counted on PS 0 as each is applied (the last bucket holds
    every tau >= STALENESS_BUCKETS - 1). Not model state: in no collection, set up by rank 0."""
    buckets = STALENESS_BUCKETS
    with tf.device("/job:ps/task:0"), tf.compat.v1.colocate_with(None, ignore_existing=True):
        histogram = tf.compat.v1.Variable(tf.zeros([topo.size, buckets], tf.int64), trainable=False,
                                          use_resource=True, collections=[], name="parallax_ps0/staleness")
        bucket = tf.clip_by_value(tf.cast(push["staleness"], tf.int64), 0, buckets - 1)
        where = tf.reshape(tf.stack([tf.constant(topo.rank, tf.int64), bucket]), [1, 2])
        push["counted"] = histogram.scatter_nd_add(where, tf.ones([1], tf.int64)).op
    return histogram


def _hyper_values(optimizer, kind: str):
    """The optimizer's learning rate and hyper-parameters as TF's own apply would see them
    (Python floats become float32 tensors, as the optimizers' _prepare makes them)."""
    def tensor(value):
        value = tf_shim.call_if_callable(optimizer, value)
        return value if isinstance(value, tf.Tensor) else tf.convert_to_tensor(value)
    if kind == "adam":
        lr, beta1, beta2, epsilon = tf_shim.adam_hyper_parameters(optimizer)
        return tensor(lr), {"beta1": tensor(beta1), "beta2": tensor(beta2), "epsilon": tensor(epsilon)}
    if kind == "momentum":
        lr, momentum, use_nesterov = tf_shim.momentum_hyper_parameters(optimizer)
        return tensor(lr), {"momentum": tensor(momentum), "use_nesterov": bool(use_nesterov)}
    return tensor(tf_shim.learning_rate(optimizer)), {}


def _pull_buffers(state: _ServerState):
    """Two pull ops (global values and versions -> buffer b; each returns the newest version it
    read) and
    two swaps (buffer b -> local copies and their copy versions)."""
    tasks = [t for t in sorted(state.tasks) if "copy_version" in state.tasks[t]]
    if not tasks:
        return [], [], 0
    pulls, swaps, pull_bytes = [], [], 0
    for b in range(2):
        assigns, swap, versions = [], [], []
        for task in tasks:
            info = state.tasks[task]
            pairs = [(g, local) for g, local in info["vars"] if local is not None]
            with tf.device(f"/job:ps/task:{task}"):
                version, values = ops.versioned_read(info["version"], [g for g, _ in pairs])
            buffer_version = tf.Variable(tf.zeros([], tf.int64), trainable=False, use_resource=True,
                                         name=f"parallax_pull_{b}/version_{task}")
            state.working_copies.add(buffer_version.name)
            assigns.append(buffer_version.assign(version, read_value=False))
            swap.append(info["copy_version"].assign(buffer_version.read_value(), read_value=False))
            for (global_var, local), value in zip(pairs, values):
                buffer = tf.Variable(tf.zeros(local.shape, local.dtype.base_dtype), trainable=False,
                                     use_resource=True, name=f"parallax_pull_{b}/{local.op.name}")
                state.working_copies.add(buffer.name)
                assigns.append(buffer.assign(value, read_value=False))
                swap.append(local.assign(buffer.read_value(), read_value=False))
                if b == 0:
                    pull_bytes += local.shape.num_elements() * local.dtype.base_dtype.size
            versions.append(version)
        with tf.control_dependencies(assigns):
            # the newest of the tasks' versions: a push in flight may have reached some tasks and
            # not yet others (each task's own version goes with its values, for the staleness
            # the servers measure)
            pulls.append(tf.reduce_max(versions))
        swaps.append(tf.group(*swap))
    return pulls, swaps, pull_bytes


def _rows_read(rebuilt, rows_read, loss) -> List[tf.Tensor]:
    """The rows the step gathers from sparse variables on the servers to compute the loss."""
    names = {p.variable.op.name for e in rows_read for p in rebuilt.parts[e.name]}
    return [op.outputs[0] for op in ancestors(loss.op)
            if op.type == "ResourceGather" and op.inputs[0].op.name in names]
