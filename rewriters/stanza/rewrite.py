"""Strategy `stanza` (Stanza, arXiv 1812.10624): layer separation. Conv nodes train the layers
below the fully connected head on their own batches; FC nodes (the last ranks) train the head
on the activations of the conv nodes they serve. Only the cut's activations (and the labels)
and their gradients cross between the two; the head's weights and gradients never leave the
FC nodes, the extractor's never leave the conv nodes.

One step, synchronous (each rank runs one graph; Horovod matches the collectives by name; all
are global, see rewriters/shared/exchange.py for why no process sets):
- conv node: runs the extractor on its batch (a copy per micro-batch); sends the cut tensors to
  its FC node (alltoall); receives the gradient of its activations; backpropagates it into the
  extractor; sums the extractor's gradients with the other conv nodes (allreduce, FC nodes
  adding zeros); runs the model's own transform and applies for the extractor's variables.
- FC node: receives its group's cut tensors, concatenated in rank order; runs the head's
  forward and backward on them (the model's own ops, rewired to read what arrived; a copy per
  further micro-batch) on their summed loss, returns each conv node the gradient of its rows,
  and sums the head's gradients with the other FC nodes (reduce-scatter + allgather among them).
  The global batch B comes from one allreduce of row counts: dividing by it makes the sums over
  FC and conv nodes the gradient of the single-device loss on the concatenated batch (a mean
  over examples, as every strategy here assumes). Runs the model's transform and applies for
  the head's variables.
Both run the model's global-step increment, so every rank's copy of the step agrees.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List

import tensorflow as tf

from parallax_tf.errors import ModelError
from parallax_tf.graph_walk import FED_INPUT_OPS, INPUT_OPS, ancestors
from parallax_tf.plan import ROUTE_ALLREDUCE, ROUTE_LOCAL
from parallax_tf.runtime.runner import SyncStep
from parallax_tf.strategy import BuildRequest, DistributedGraph
from rewriters.shared.allreduce_route import AllReduceRoute
from rewriters.shared import exchange, graph_copy, transform as transform_lib
from rewriters.shared.pipeline import applied_optimizers, check_routes, finish_graph, start_variables
from rewriters.shared.pruning import update_without, variable_and_slot_ops
from rewriters.shared.rebuild import advancing_global_step, gradients, rebuild
from rewriters.shared.step_report import StepReport, tensor_bytes
from rewriters.stanza.cut import ACTIVATION, DATA, REPLICATED
from rewriters.stanza.runner import SplitRunner, data_shard
from rewriters.stanza.split import ROUTE_FC_NODE


def rewrite(request: BuildRequest) -> DistributedGraph:
    plan, topo = request.plan, request.topology
    split = plan.section
    if split is None:
        raise ValueError("the stanza rewriter needs a plan with a layer split (planner strategy 'stanza')")
    check_routes(plan, {ROUTE_FC_NODE, ROUTE_LOCAL, ROUTE_ALLREDUCE}, "stanza")
    on_fc = topo.rank in split.fc_ranks
    # model_fn's ctx counts the conv nodes: they are the data shards (FC nodes read no data)
    data_rank, _ = data_shard(split, topo.rank) or (0, None)
    request = dataclasses.replace(request, ctx=dataclasses.replace(request.ctx, rank=data_rank, batch_joined=True,
                                                                   size=len(split.conv_ranks)))
    rebuilt = rebuild(request, on_servers=[])
    training = rebuilt.training
    rebuilt.require_a_gradient()
    graph = tf.compat.v1.get_default_graph()
    head = {v.name for v in plan.on_route(ROUTE_FC_NODE)}
    head_state = {v.name for v in plan.on_route(ROUTE_LOCAL) if v.params.get("ranks") == split.fc_ranks}
    target, global_step = advancing_global_step(training, topo.worker_device)
    cut = [(spec, graph.get_tensor_by_name(spec.name)) for spec in split.cut]
    built = (_FCSide if on_fc else _ConvSide)(request, rebuilt, split, cut, head).build()
    # what this rank does not update: the other side's variables, their slots, its state
    other_side = set(rebuilt.parts) - head if on_fc else head
    other_state = _state_names(plan) - head_state if on_fc else head_state
    theirs = variable_and_slot_ops(training, rebuilt.parts, other_side) | other_state
    step = update_without(training, target, theirs, built.global_grads, "parallax_stanza_token",
                          check=lambda transform, needs: _check_transform(transform, needs, rebuilt, other_side))
    _check_no_data_needed(step, on_fc)
    # its own collective: the two sides' gradient groups differ
    report = StepReport(built.loss_share, topo.size, built.metric_shares)
    summed = report.summed()
    step_spec = SyncStep(report=summed, report_routes=sorted(built.bytes), metric_names=report.metric_names,
                         metric_sizes=report.metric_sizes, checkpoint_request=report.checkpoint_request,
                         previous_bytes=report.previous_bytes, bytes_per_step=built.bytes,
                         lower_bound_bytes=tf.add_n(built.lower_bound or [tf.constant(0, tf.int64)]))
    targets = [step] + built.targets
    return finish_graph(start_variables(), loss=summed[0], train_op=targets, global_step=global_step,
                        parts=rebuilt.parts, runner=SplitRunner(summed[0], targets, step_spec, split),
                        optimizers=applied_optimizers(training), broadcast_local=True)


@dataclasses.dataclass
class _Built:
    global_grads: Dict[str, object]    # variable op name -> its global gradient on this rank
    targets: List[tf.Operation]        # collectives this rank must submit but does not use
    loss_share: tf.Tensor              # this rank's share of the step's loss (float64)
    metric_shares: Dict[str, tf.Tensor]   # Model.metrics, each as the step report sums them over ranks
    bytes: Dict[str, tf.Tensor]
    lower_bound: List[tf.Tensor]


class _Side:
    def __init__(self, request, rebuilt, split, cut, head):
        self.request, self.rebuilt, self.split, self.cut, self.head = request, rebuilt, split, cut, head
        self.size = request.topology.size
        self.group = split.group_of(request.topology.rank)      # its conv nodes, then its FC node
        self.extractor = {n: p for n, p in rebuilt.parts.items() if n not in head}
        self.head_parts = {n: p for n, p in rebuilt.parts.items() if n in head}
        self.targets: List[tf.Operation] = []
        self.turn = self.group.index(request.topology.rank)   # a conv node's position in its group

    def _turns(self, spec) -> list:
        """The collectives of one cut tensor each way: one for all conv nodes (None), or, staggered,
        one per position in a group, where the k-th conv node of every group sends its activations
        (and gets their gradient back). Horovod runs them one after another, and gloo writes a
        message only once its receiver has posted the receive, so an FC node's port carries one
        conv node's rows at a time each way."""
        if spec.kind != ACTIVATION or not self.split.staggered:       # labels are too small to matter
            return [None]
        return list(range(max(len(g) for g in self.split.groups)))

    def _batch(self, rows) -> tf.Tensor:
        """The global batch: conv nodes' rows summed (FC nodes add 0)."""
        import horovod.tensorflow as hvd
        return tf.cast(hvd.allreduce(tf.cast(rows, tf.int32), op=hvd.Sum, name="parallax_stanza_batch"), tf.float64)

    def _sum_extractor(self, grads):
        """The extractor's gradients summed over the conv nodes (`grads`: this rank's part)."""
        entries = [e for e in self.request.plan.variables if e.name in self.extractor]
        route = AllReduceRoute(self.request, dataclasses.replace(self.rebuilt, parts=self.extractor, grads=grads),
                               entries, name="parallax_stanza_extractor", summed=True)
        return route, route.build()

    def _sum_head(self, grads):
        """Variable op name -> the head's gradient summed over the FC nodes (`grads`: name ->
        per piece; None off them). Dense only: sparse ones would need an allgather among them
        (the planner refuses them with F > 1)."""
        fc = self.split.fc_ranks
        order = [(n, i, p.variable) for n, pieces in self.head_parts.items() for i, p in enumerate(pieces)]
        out = {v.op.name: grads[n][i] for n, i, v in order} if grads else None
        if len(fc) == 1:
            return out, tf.constant(0, tf.int64)
        sent = []
        for dtype in sorted({v.dtype.base_dtype for _, _, v in order}, key=lambda d: d.name):
            mine = [(n, i, v) for n, i, v in order if v.dtype.base_dtype == dtype]
            specs = [(v.shape.as_list(), dtype) for _, _, v in mine]
            values = [grads[n][i] if grads[n][i] is not None else tf.zeros_like(v) for n, i, v in mine] \
                if grads else None
            sums, ops, moved = exchange.sum_among(specs, values, fc, self.size, f"parallax_stanza_head_{dtype.name}")
            self.targets.extend(ops)
            sent.append(moved)
            if sums is not None:
                out.update({v.op.name: total for (_, _, v), total in zip(mine, sums)})
        return out, tf.add_n(sent)


class _ConvSide(_Side):
    def build(self) -> _Built:
        import horovod.tensorflow as hvd
        fc = self.group[-1]
        first = self.request.topology.rank == self.group[0]       # sends the replicated tensors
        micro, rows = self._micro_batches()
        batch = self._batch(rows)
        moved, sent, ys, grad_ys = [], [], [], []      # bytes both ways / sent only (the lower bound's)
        for m, tensors in enumerate(micro):
            for i, (spec, tensor) in enumerate(self.cut):
                if spec.kind == REPLICATED and m > 0:
                    continue
                per = list(tensor.shape) if spec.kind == REPLICATED else list(tensor.shape[1:])
                if spec.kind == REPLICATED:
                    piece = tf.expand_dims(tensor, 0) if first else exchange.empty(per, tensor.dtype)
                else:
                    tensor = piece = tensors[spec.name]
                for turn in self._turns(spec):      # empty in the other conv nodes' turns
                    mine = piece if turn in (None, self.turn) else exchange.empty(per, tensor.dtype)
                    out, _ = hvd.alltoall(mine, splits=exchange.splits_to(fc, tf.shape(mine)[0], self.size),
                                          name=_name("forward", i, m, turn))
                    self.targets.append(out.op)
                moved.append(tensor_bytes(piece))
                sent.append(moved[-1])
                if spec.kind == DATA:
                    continue
                answers = [hvd.alltoall(exchange.empty(per, tensor.dtype), splits=exchange.nothing(self.size),
                                        name=_name("backward", i, m, turn))[0] for turn in self._turns(spec)]
                self.targets.extend(a.op for a in answers)
                grad = answers[0] if len(answers) == 1 else answers[self.turn]     # rows only in its own turn
                moved.append(tensor_bytes(grad))           # received: the link carries both ways
                if spec.kind != REPLICATED or first:
                    # the FC node sends the gradient of its examples' summed loss; the mean is over B
                    ys.append(tensor)
                    grad_ys.append(tf.reshape(grad, tf.shape(tensor)) / tf.cast(batch, tensor.dtype))
        route, global_grads = self._sum_extractor(gradients(ys, grad_ys, self.extractor, set()))
        self._sum_head(None)                       # takes part in the FC nodes' sum
        metrics = self.rebuilt.training.model.metrics or {}
        nothing = {name: tf.zeros(value.shape, tf.float64) for name, value in metrics.items()}
        return _Built(global_grads, self.targets, tf.constant(0.0, tf.float64), nothing,
                      dict(route.bytes, activations=tf.add_n(moved)), route.lower_bound + sent)

    def _micro_batches(self):
        """Per micro-batch, the per-example cut tensors computed on that slice of the batch (the
        feature extractor's forward copied once per micro-batch, so the executor overlaps one's
        round trip with the next one's compute); and the batch's row count."""
        count = self.split.microbatches
        per_example = [t for spec, t in self.cut if spec.kind != REPLICATED]
        if count == 1:
            return [{t.name: t for t in per_example}], tf.shape(per_example[0])[0]
        inputs = _batch_inputs(per_example)
        rows = tf.shape(inputs[0])[0]
        enough = tf.debugging.assert_greater_equal(
            rows, count, message=f"--stanza_microbatches={count} is more than the examples in this conv node's batch")
        with tf.control_dependencies([enough]):
            sizes = tf.stack([(rows + count - 1 - m) // count for m in range(count)])
        pieces = {x.name: tf.split(x, sizes, num=count, axis=0) for x in inputs}
        micro = []
        for m in range(count):
            copies = graph_copy.copy_between({name: p[m] for name, p in pieces.items()}, per_example,
                                             suffix=f"/parallax_micro{m}")
            micro.append({t.name: c for t, c in zip(per_example, copies)})
        return micro, rows


class _FCSide(_Side):
    def build(self) -> _Built:
        losses, received, moved = self._receive()
        batch = self._batch(exchange.unfolded_zero())
        xs = [p.variable for parts in self.head_parts.values() for p in parts]
        # each micro-batch's loss times its rows: the FC node works with its examples' summed loss
        weights = [tf.cast(tf.shape(next(v for s, v, _ in got if s.kind == ACTIVATION))[0], tf.float64)
                   for got in received]
        own = {n: [None] * len(p) for n, p in self.head_parts.items()}
        back = {}                       # cut index -> per micro-batch gradient
        for loss, got, w in zip(losses, received, weights):
            inputs = [(i, v) for i, (s, v, _) in enumerate(got) if s.kind != DATA]
            dys = tf.gradients(loss, xs + [v for _, v in inputs])
            k = 0
            for name, parts in self.head_parts.items():
                own[name] = [exchange.add(total, exchange.scale(g, w / batch))
                             for total, g in zip(own[name], dys[k:k + len(parts)])]
                k += len(parts)
            for (i, value), grad in zip(inputs, dys[len(xs):]):
                back.setdefault(i, []).append(exchange.scale(grad, w) if grad is not None else tf.zeros_like(value))
        sent = self._send_back(back, received)
        moved += sent
        summed, head_bytes = self._sum_head(own)
        # the FC node adds zeros to the conv nodes' sum of the extractor's gradients
        route, discarded = self._sum_extractor({n: [self._nothing_for(n, p.variable) for p in parts]
                                                for n, parts in self.extractor.items()})
        self.targets.extend(op for g in discarded.values() for op in _ops_of(g))
        route.bytes["allreduce"] = route.bytes["allreduce"] + head_bytes
        loss_share = tf.add_n([tf.cast(loss, tf.float64) * w for loss, w in zip(losses, weights)]) / batch
        # the model's metrics read the first (with metrics: the only) micro-batch, weighted by its
        # rows; the report divides what it sums by the ranks
        metrics = {name: tf.cast(value, tf.float64) * weights[0] / batch * self.size
                   for name, value in (self.rebuilt.training.model.metrics or {}).items()}
        return _Built(summed, self.targets, loss_share, metrics, dict(route.bytes, activations=tf.add_n(moved)),
                      route.lower_bound + sent + [head_bytes])

    def _receive(self):
        """Per micro-batch: the loss of the head on what arrived, and (spec, value, rows per
        sender) per cut tensor; and the bytes received."""
        import horovod.tensorflow as hvd
        graph = tf.compat.v1.get_default_graph()
        losses, received, moved = [], [], []
        for m in range(self.split.microbatches):
            got = []
            for i, (spec, tensor) in enumerate(self.cut):
                if spec.kind == REPLICATED and m > 0:
                    got.append(received[0][i])
                    continue
                per = list(tensor.shape) if spec.kind == REPLICATED else list(tensor.shape[1:])
                pieces = [hvd.alltoall(exchange.empty(per, tensor.dtype), splits=exchange.nothing(self.size),
                                       name=_name("forward", i, m, turn)) for turn in self._turns(spec)]
                # the turns go in group order, the group in rank order: as one alltoall concatenates
                value = tf.concat([v for v, _ in pieces], 0) if len(pieces) > 1 else pieces[0][0]
                rows = tf.add_n([r for _, r in pieces])
                got.append((spec, tf.reshape(value, tensor.shape) if spec.kind == REPLICATED else value, rows))
                moved.append(tensor_bytes(value))
            if m == 0:        # the model's own head reads the first micro-batch
                for (spec, tensor), (_, value, _) in zip(self.cut, got):
                    transform_lib.rewire(tensor, value, set(graph.get_operations()))
                losses.append(self.rebuilt.training.loss)
            else:             # a copy of the head reads each other one
                swap = {first.name: value for (_, first, _), (_, value, _) in zip(received[0], got) if first is not value}
                losses.append(graph_copy.copy_between(swap, [self.rebuilt.training.loss],
                                                      suffix=f"/parallax_micro{m}")[0])
            received.append(got)
        return losses, received, moved

    def _send_back(self, back: dict, received) -> list:
        """Each conv node the gradient of its rows (a replicated tensor's, summed over
        micro-batches, to the conv node that sent it); returns the bytes sent."""
        import horovod.tensorflow as hvd
        moved = []
        for i, grads in back.items():
            if self.cut[i][0].kind == REPLICATED:
                pieces = [(tf.expand_dims(tf.add_n(grads), 0), exchange.splits_to(self.group[0], 1, self.size), 0)]
            else:
                pieces = [(g, received[m][i][2], m) for m, g in enumerate(grads)]
            for grad, rows, m in pieces:
                for turn in self._turns(self.cut[i][0]):
                    part, splits = (grad, rows) if turn is None else self._rows_of(turn, grad, rows)
                    answer, _ = hvd.alltoall(part, splits=splits, name=_name("backward", i, m, turn))
                    self.targets.append(answer.op)
                moved.append(tensor_bytes(grad))
        return moved

    def _rows_of(self, turn: int, grad, rows):
        """The rows of `grad` (concatenated in rank order, `rows` per rank) that go back to the
        conv node in position `turn` of this FC node's group, and the splits sending them there."""
        members = self.group[:-1]
        if turn >= len(members):          # a smaller group than another FC node's: nothing this turn
            return exchange.empty(grad.shape.as_list()[1:], grad.dtype), exchange.nothing(self.size)
        to = members[turn]
        start = tf.reduce_sum(rows[:to])
        return grad[start:start + rows[to]], exchange.splits_to(to, rows[to], self.size)

    def _nothing_for(self, name: str, variable):
        """This rank's (zero) part of a sum over the conv nodes: dense zeros, or no rows."""
        if self.request.plan.by_name()[name].gradient == "sparse":
            values = exchange.empty(variable.shape.as_list()[1:], variable.dtype.base_dtype)
            return tf.IndexedSlices(values, tf.cast(exchange.empty([], tf.int64), tf.int64),
                                    tf.constant(variable.shape.as_list(), tf.int64))
        return exchange.zeros(variable.shape, variable.dtype.base_dtype)


def _state_names(plan) -> set:
    return {v.name for v in plan.on_route(ROUTE_LOCAL)}


def _check_transform(transform, step_needs: set, rebuilt, remote: set) -> None:
    """The model's transform on this rank may not need the other side's gradients."""
    remote_ops = {p.variable.op.name for name in remote for p in rebuilt.parts[name]}
    for op, deps in transform.depends.items():
        if op in step_needs and deps & remote_ops:
            raise ModelError(f"gradient transform op {op.name!r} combines the gradients of the FC head and of the layers "
                             "below it (e.g. clip_by_global_norm over all variables); stanza trains them on different "
                             "ranks and does not support that yet. Transform each side separately or use "
                             "--strategy hybrid")


def _check_no_data_needed(step, on_fc: bool) -> None:
    if not on_fc:
        return
    fed = [op.name for op in ancestors(step if isinstance(step, tf.Operation) else step.op)
           if op.type in FED_INPUT_OPS]
    if fed:
        raise ModelError(f"the FC head's update needs input {fed[0]!r} directly (not through the cut); FC nodes read "
                         "no data. Make the head use it only through a tensor the cut carries, or use --strategy hybrid")


def _ops_of(grad) -> list:
    return [grad.values.op, grad.indices.op] if isinstance(grad, tf.IndexedSlices) else [grad.op]


def _name(direction: str, index: int, micro: int, turn=None) -> str:
    return f"parallax_stanza_{direction}_{index}" + (f"_{micro}" if micro else "") + \
        (f"_turn{turn}" if turn is not None else "")


def _batch_inputs(tensors) -> list:
    """The model's inputs (placeholders, iterator outputs) with a batch dimension that the
    tensors are computed from."""
    ops = set().union(*(ancestors(t.op, data_only=True) for t in tensors))
    used = {t for op in ops for t in op.inputs} | set(tensors)
    return sorted((t for t in used if t.op.type in INPUT_OPS and t.shape.rank), key=lambda t: t.name)
