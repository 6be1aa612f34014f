"""Strategy `dsp` (DSP, Xu et al., CVPR 2020, arXiv 1909.02625): pipelined model parallelism
with layer-wise staleness. The model is cut into K consecutive stages, stage k on rank
p * K + k of pipeline p. Each stage keeps one copy of its variables; at tick t stage k
forwards batch t - k with its current variables and stores the stage input, then takes the
gradient of batch t - 2(K-1) + k's output (sent by stage k+1 one tick earlier), recomputes its
forward on that batch's stored input with its current variables, backpropagates, sends the
input gradient down and updates: the staleness of stage k is 2(K-1-k).

Stages talk through TF's runtime: each stage's incoming activations and gradients wait in a
FIFO queue on its own server, which the neighbour enqueues into (a message is the batch id,
the tensor and, upward, the raw inputs later stages read (labels); downward, the batch's loss).
The stored inputs live in the toolkit's compiled stash (parallax_tf/ops/stash_ops.cc), which
refuses to hand backward any batch but the one the schedule expects.

Each rank builds the whole single-device model (its variables all exist, named as on one
device) and runs three graphs made from it: the forward of its stage (a copy reading what
arrived), the backward (a copy reading the stored input, differentiated with the gradient that
arrived) whose gradients feed the model's own apply ops for the stage's variables (the other
stages' applies are pruned), and, on the last stage, both in one; runner.py runs the ticks.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import tensorflow as tf

from parallax_tf import ops as compiled
from parallax_tf.errors import ModelError
from parallax_tf.graph_walk import INPUT_OPS, ancestors
from parallax_tf.plan import ROUTE_LOCAL
from parallax_tf.strategy import BuildRequest, DistributedGraph
from rewriters.dsp.pipeline import ROUTE_STAGE
from rewriters.dsp.runner import PipelineRunner
from rewriters.shared import exchange, graph_copy
from rewriters.shared.pipeline import applied_optimizers, check_routes, finish_graph, start_variables
from rewriters.shared.pruning import update_without, variable_and_slot_ops
from rewriters.shared.rebuild import advancing_global_step, rebuild
from rewriters.shared.step_report import tensor_bytes


@dataclasses.dataclass
class StageGraph:
    """What the runner fetches and feeds on one rank."""
    stage: int
    stages: int
    pipeline: int                 # which pipeline this rank is in, of `pipelines`
    pipelines: int
    locked: bool                  # one batch in the pipeline at a time (the baseline DSP removes)
    forward: Optional[dict]       # fetches of a forward run (None on the last stage)
    backward: dict                # fetches of a backward run (the last stage: forward and backward)
    forward_batch: tf.Tensor      # placeholders: which batch this run forwards / updates with
    backward_batch: tf.Tensor
    stored: tf.Tensor             # batches in the stash, oldest first
    # with several pipelines: per other stage, the ops this rank runs to take part in averaging
    # that stage's gradients over its replicas (global collectives), at the ticks it updates
    joins: Dict[int, list] = dataclasses.field(default_factory=dict)


def rewrite(request: BuildRequest) -> DistributedGraph:
    plan, topo = request.plan, request.topology
    pipe = plan.section
    if pipe is None:
        raise ValueError("the dsp rewriter needs a plan with a pipeline (planner strategy 'dsp')")
    check_routes(plan, {ROUTE_STAGE, ROUTE_LOCAL}, "dsp")
    k, count = pipe.stage_of(topo.rank), len(pipe.stages)
    # model_fn's ctx counts pipelines: each reads its own data shard
    request = dataclasses.replace(request, ctx=dataclasses.replace(request.ctx, rank=pipe.pipeline_of(topo.rank),
                                                                   size=pipe.replicas))
    rebuilt = rebuild(request, on_servers=[])
    if rebuilt.training.model.metrics:
        raise ModelError("Model(metrics=...) is not reported under --strategy dsp "
                         "(each stage computes a part of the model); drop metrics or use a "
                         "data-parallel strategy (hybrid, ps, allreduce, auto, slim_dp, ps_plus)")
    graph = tf.compat.v1.get_default_graph()
    compiled.load()
    cuts = [graph.get_tensor_by_name(s.input) if s.input else None for s in pipe.stages]
    ends = cuts[1:] + [rebuilt.loss]                       # what each stage computes
    lows = [ancestors(c.op, data_only=True) if c is not None else set() for c in cuts]
    forward_ops = ancestors(rebuilt.loss.op, data_only=True)
    highs = lows[1:] + [forward_ops]
    raw_inputs = [_inputs_read(highs[j] - lows[j]) for j in range(count)]
    carried = [sorted(set().union(*raw_inputs[j:]), key=lambda t: t.name) for j in range(count + 1)]  # into stage j
    mine = pipe.stages[k]
    parts = {n: p for n, p in rebuilt.parts.items() if n in mine.variables}
    builder = _Stage(request, rebuilt, k, count, cuts[k], ends[k], raw_inputs[k], carried, parts)
    stage_graph, global_grads, _ = builder.build(pipe.grad_scale if k < count - 1 else 1.0)
    if pipe.replicas > 1:
        global_grads, stage_graph.joins, replica_bytes = _average_over_replicas(rebuilt, plan, topo, global_grads)
        stage_graph.backward["bytes"] += replica_bytes
    # the update runs with the data fed only when stage 0 forwards in the same run
    reads_data = count == 1 or (k == 0 and pipe.schedule == "locked")
    step, global_step = _update_step(rebuilt, global_grads, set(rebuilt.parts) - set(mine.variables), topo, reads_data)
    stage_graph.backward["train"] = step
    return finish_graph(start_variables(), loss=stage_graph.backward["loss"], train_op=[step],
                        global_step=global_step, parts=rebuilt.parts, runner=PipelineRunner(stage_graph),
                        optimizers=applied_optimizers(rebuilt.training), broadcast_local=True)


class _Stage:
    def __init__(self, request, rebuilt, k, count, cut, end, raw, carried, parts):
        self.request, self.rebuilt, self.k, self.count = request, rebuilt, k, count
        self.cut, self.end, self.raw, self.carried, self.parts = cut, end, raw, carried, parts
        self.topo = request.topology
        self.first, self.last = k == 0, k == count - 1
        self.locked = request.plan.section.schedule == "locked"

    def _queue(self, stage: int, kind: str, like: list):
        """The queue on `stage`'s rank (of this pipeline) that its `kind` messages wait in; a
        message holds a value like each of `like` (a tensor, or a dtype for a scalar). Both
        neighbours build it alike, so TF's runtime finds one queue by its shared name."""
        pipe = self.request.plan.section
        rank = pipe.pipeline_of(self.topo.rank) * self.count + stage
        dtypes = [x.dtype if isinstance(x, tf.Tensor) else x for x in like]
        with tf.device(f"/job:worker/task:{rank}"):
            queue = tf.queue.FIFOQueue(2 * self.count + 2, dtypes, shared_name=f"parallax_dsp_{kind}_{rank}",
                                       name=f"parallax_dsp_{kind}_{rank}")
        return _Queue(queue, [x.shape if isinstance(x, tf.Tensor) else tf.TensorShape([]) for x in like])

    def _activation_queue(self, stage: int):
        """Into `stage`: batch id, the activation, then the raw inputs it and later stages read."""
        carried = self.carried[stage]
        cut = self.rebuilt.loss.graph.get_tensor_by_name(self.request.plan.section.stages[stage].input)
        return self._queue(stage, "activation", [tf.int64, cut] + carried)

    def _gradient_queue(self, stage: int):
        """Into `stage` from the one above: batch id, the batch's loss, the gradient of the activation."""
        cut = self.rebuilt.loss.graph.get_tensor_by_name(self.request.plan.section.stages[stage + 1].input)
        return self._queue(stage, "gradient", [tf.int64, tf.float64, cut])

    def build(self, scale: float):
        forward_batch = tf.compat.v1.placeholder(tf.int64, [], name="parallax_dsp_forward_batch")
        backward_batch = tf.compat.v1.placeholder(tf.int64, [], name="parallax_dsp_backward_batch")
        xs = [p.variable for parts in self.parts.values() for p in parts]
        moved = []            # bytes a backward run moves
        activation, carried_in, output, stored_like, stored_now = self._forward(forward_batch)
        forward = stash = locked_forward = None
        if self.last:
            loss = tf.cast(output, tf.float64)
            ys, inputs_xs, grad_ys, with_loss = output, [activation] if not self.first else [], None, loss
        else:
            stash, forward = self._send_up(forward_batch, output, carried_in, stored_like, stored_now)
            grad_ys, with_loss = self._gradient_from_above(backward_batch, moved)
            if self.locked:       # one batch in the pipeline: backpropagate this run's own forward
                ys, inputs_xs = output, [activation] if not self.first else []
                moved.append(forward.pop("bytes"))
                locked_forward, forward = forward, None
            else:
                ys, inputs_xs = self._recompute(stash, backward_batch, stored_like)
        dys = tf.gradients(ys, xs + inputs_xs, grad_ys=grad_ys)
        grads = {}
        for var, dy in zip(xs, dys):
            if dy is not None:
                grads[var.op.name] = _gated(_scaled(dy, scale), ys.op)
        backward = {"loss": with_loss}
        if self.locked and not self.last:
            backward.update(sent_up=locked_forward["sent"], rows=locked_forward["rows"])
        if not self.first:        # the gradient of what arrived goes to the stage below
            backward["sent"] = self._send_down(backward_batch, with_loss, dys[len(xs)], moved)
        if self.last and not self.first:
            backward["rows"] = tf.shape(activation)[0]
        stored_batches = compiled.stash_batches(stash) if forward is not None else tf.zeros([0], tf.int64)
        backward["bytes"] = tf.add_n(moved) if moved else tf.constant(0, tf.int64)
        pipe = self.request.plan.section
        return (StageGraph(self.k, self.count, pipe.pipeline_of(self.topo.rank), pipe.replicas, self.locked, forward,
                           backward, forward_batch, backward_batch, stored_batches),
                grads, {"activations": backward["bytes"]})

    def _forward(self, forward_batch):
        """This stage's forward on its input, from the data or from the stage below (of the batch
        the schedule forwards): (the activation that arrived, the raw inputs carried in, the
        output, what a stored input holds, and its values now)."""
        activation = None
        if self.first:
            inputs, carried_in = {}, {t.name: t for t in self.carried[0]}
        else:
            got = self._activation_queue(self.k).dequeue(name="parallax_dsp_receive_activation")
            check = _same_batch(got[0], forward_batch, f"stage {self.k}: the activation that arrived")
            with tf.control_dependencies([check]):
                activation = tf.identity(got[1])
            carried_in = {t.name: value for t, value in zip(self.carried[self.k], got[2:])}
            inputs = {self.cut.name: activation}
        replace = dict(inputs, **{t.name: carried_in[t.name] for t in self.raw if not self.first})
        stored_like = ([self.cut] if not self.first else []) + list(self.raw)
        stored_now = [replace.get(t.name, t) for t in stored_like]
        output = graph_copy.copy_between(replace, [self.end], "/parallax_dsp_forward")[0] if replace else self.end
        return activation, carried_in, output, stored_like, stored_now

    def _send_up(self, forward_batch, output, carried_in, stored_like, stored_now):
        """(the stash that keeps this batch's input for its backward, None when locked; the
        fetches of a forward run): the output goes up with the raw inputs later stages read."""
        stash = None if self.locked else compiled.input_stash(
            [t.dtype for t in stored_like], capacity=2 * self.count, stage=self.k,
            shared_name=f"parallax_dsp_stash_{self.topo.rank}")
        put = [] if self.locked else [compiled.stash_put(stash, forward_batch, stored_now)]
        up = self._activation_queue(self.k + 1)
        message = [forward_batch, output] + [carried_in[t.name] for t in self.carried[self.k + 1]]
        with tf.control_dependencies(put):
            sent = up.enqueue(message, name="parallax_dsp_send_activation")
        return stash, {"sent": sent, "rows": tf.shape(output)[0],
                       "bytes": tensor_bytes(output) + tf.add_n([tf.constant(8, tf.int64)] + [
                           tensor_bytes(carried_in[t.name]) for t in self.carried[self.k + 1]])}

    def _gradient_from_above(self, backward_batch, moved: list):
        """(the gradient of this stage's output, the batch's loss) as the stage above sent them."""
        back = self._gradient_queue(self.k).dequeue(name="parallax_dsp_receive_gradient")
        check = _same_batch(back[0], backward_batch, f"stage {self.k}: the gradient that arrived")
        with tf.control_dependencies([check]):
            grad_ys = tf.identity(back[2])
        moved.append(tensor_bytes(back[2]))
        return grad_ys, back[1]

    def _recompute(self, stash, backward_batch, stored_like):
        """(the forward recomputed on the stored input of the batch the gradient belongs to, with
        the current variables; the stored activation it is differentiated by)."""
        stored = compiled.stash_take(stash, backward_batch, stored_like)
        again = graph_copy.copy_between({t.name: v for t, v in zip(stored_like, stored)}, [self.end],
                                        "/parallax_dsp_recompute")[0]
        return again, stored[:1] if not self.first else []

    def _send_down(self, backward_batch, with_loss, dx, moved: list):
        """The gradient of what arrived, sent to the stage below."""
        down = self._gradient_queue(self.k - 1)
        if dx is None:
            raise ModelError(f"stage {self.k}'s output does not depend on its input {self.cut.name!r}")
        sent = down.enqueue([backward_batch, with_loss, dx], name="parallax_dsp_send_gradient")
        moved.append(tensor_bytes(dx) + 16)
        return sent


def _update_step(rebuilt, global_grads: Dict[str, object], others: set, topo, reads_data: bool):
    """(step, global step): the model's own train op for this stage's variables, reading
    `global_grads` (variable op name -> gradient), the other stages' applies (and their slots'
    updates) pruned."""
    training = rebuilt.training
    target, global_step = advancing_global_step(training, topo.worker_device)
    step = update_without(training, target, variable_and_slot_ops(training, rebuilt.parts, others), global_grads,
                          "parallax_dsp_token", check=lambda transform, _: _check_stages_apart(transform, global_grads))
    fed = [op.name for op in ancestors(step if isinstance(step, tf.Operation) else step.op) if op.type in INPUT_OPS
           and op.name not in ("parallax_dsp_forward_batch", "parallax_dsp_backward_batch")]
    if fed and not reads_data:
        raise ModelError(f"a stage's update needs input {fed[0]!r} directly, not through its stage's forward; dsp "
                         "cannot replay it for a stale batch. Use --strategy hybrid")
    return step, global_step


def _average_over_replicas(rebuilt, plan, topo, grads: Dict[str, object]):
    """(this stage's gradients averaged over its replicas, per other stage the ops this rank runs
    to take part in averaging that stage's, bytes this rank sends). Global collectives in which
    the other stages' ranks send nothing (rewriters/shared/exchange.py: why no process sets): dense
    gradients summed among the replicas by reduce-scatter + allgather, sparse ones allgathered."""
    import horovod.tensorflow as hvd
    pipe = plan.section
    mine = pipe.stage_of(topo.rank)
    sparse = {v.name for v in plan.variables if v.gradient == "sparse"}
    averaged, joins, sent = {}, {}, [tf.constant(0, tf.int64)]
    for stage in pipe.stages:
        own = stage.index == mine
        variables = [p.variable for n in stage.variables for p in rebuilt.parts[n]]
        dense = [v for v in variables if v.op.name in grads or not own]
        dense = [v for v in dense if _logical(v, rebuilt) not in sparse]
        ops = []
        for dtype in sorted({v.dtype.base_dtype for v in dense}, key=lambda d: d.name):
            group = [v for v in dense if v.dtype.base_dtype == dtype]
            values = [grads[v.op.name] for v in group] if own else None
            sums, done, moved = exchange.sum_among([(v.shape.as_list(), dtype) for v in group], values, stage.ranks,
                                                   topo.size, f"parallax_dsp_stage{stage.index}_{dtype.name}")
            ops += done
            sent.append(moved)
            if sums is not None:
                averaged.update({v.op.name: s / len(stage.ranks) for v, s in zip(group, sums)})
        for v in variables:
            if _logical(v, rebuilt) not in sparse or (own and v.op.name not in grads):
                continue
            name = f"parallax_dsp_stage{stage.index}_{v.op.name.replace('/', '_')}"
            grad = grads[v.op.name] if own else None
            values = grad.values if own else exchange.empty(v.shape.as_list()[1:], v.dtype.base_dtype)
            indices = tf.cast(grad.indices, tf.int64) if own else tf.cast(exchange.empty([], tf.int64), tf.int64)
            all_values, all_indices = hvd.allgather(values, name=name + "_values"), hvd.allgather(indices, name=name + "_rows")
            ops += [all_values.op, all_indices.op]
            if own:
                averaged[v.op.name] = tf.IndexedSlices(all_values / len(stage.ranks), all_indices, grad.dense_shape)
                sent.append(tensor_bytes(grad))
        if not own:
            joins[stage.index] = ops
    return averaged, joins, tf.add_n(sent)


def _logical(variable, rebuilt) -> str:
    return next(n for n, parts in rebuilt.parts.items() if any(p.variable is variable for p in parts))


def _check_stages_apart(transform, global_grads: Dict[str, object]) -> None:
    for op, deps in transform.depends.items():
        if deps - set(global_grads) and deps & set(global_grads):
            raise ModelError(f"gradient transform op {op.name!r} combines gradients of variables in different "
                             "pipeline stages (e.g. clip_by_global_norm over all variables); dsp updates each "
                             "stage on its own rank. Transform each variable's gradient alone or use --strategy hybrid")


def _inputs_read(ops: set) -> List[tf.Tensor]:
    """The model's raw inputs (placeholders, iterator outputs) these ops read."""
    found = {t.name: t for op in ops for t in op.inputs if t.op.type in INPUT_OPS}
    return [found[n] for n in sorted(found)]


class _Queue:
    """A FIFOQueue whose dequeued values get back the static shapes of what was enqueued."""

    def __init__(self, queue, shapes):
        self.queue, self.shapes = queue, shapes

    def enqueue(self, values, name):
        return self.queue.enqueue(values, name=name)

    def dequeue(self, name):
        values = self.queue.dequeue(name=name)
        for value, shape in zip(values, self.shapes):
            value.set_shape(shape)
        return values


def _same_batch(got, expected, what: str):
    return tf.debugging.assert_equal(got, expected, message=f"{what} is of another batch than the schedule's; "
                                     "the pipeline's messages are out of order")


def _scaled(grad, scale: float):
    if scale == 1.0:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * scale, grad.indices, grad.dense_shape)
    return grad * scale


def _gated(grad, after: tf.Operation):
    """The gradient, available only once `after` ran: the update never races a read of the
    stage's variables by the computation it belongs to."""
    with tf.control_dependencies([after]):
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(tf.identity(grad.values), tf.identity(grad.indices), grad.dense_shape)
        return tf.identity(grad)
