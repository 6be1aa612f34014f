"""inspect: build the user's single-device graph once and describe every trainable variable.

The capture graph is scratch: it is evaluated on rank 0's side to get the single-device initial
values (so any partitioning starts from exactly what a single device would) and to measure how
many rows of each sparse variable one real batch touches.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from parallax_tf import dynamic, front_end as front_end_lib, graph_walk, input_shard, model_init, training_record
from parallax_tf.captured import Capture, StateInfo, VariableInfo
from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.errors import ModelError
from parallax_tf.feeds import make_feeds
from parallax_tf.model import RunContext
from parallax_tf import threads as pool_threads

_CONV_OPS = {"Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput", "Conv1D"}
_MATMUL_OPS = {"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"}
_GATHER_OPS = {"Gather", "GatherV2", "ResourceGather"}
_NORM_OPS = {"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "BatchNormWithGlobalNormalization"}


@dataclasses.dataclass
class CaptureView:
    """What a strategy's Measure sees of the captured model: `measure(view)` returns what the
    strategy's planning rule needs (Capture.measured[measure.name])."""
    graph: tf.Graph
    training: object                        # training_record.Training
    groups: Dict[str, list]                 # logical name -> [(variable, raw gradient)]
    layers: Dict[str, str]                  # logical name -> layer kind
    state_vars: Dict[str, tf.Variable]      # model state by logical name
    feeds: dict                             # one batch (empty where inspection does not evaluate)
    initializers: list
    evaluate: bool
    time_compute: bool
    process: pool_threads.ProcessConfig = pool_threads.ProcessConfig()

    @contextlib.contextmanager
    def session(self):
        """A session of the capture graph, initialised as a single-device script does."""
        with tf.compat.v1.Session(graph=self.graph, config=self.process.proto()) as sess:
            _initialise(sess, self.initializers)
            yield sess

    @staticmethod
    def time_step(sess, fetches, feeds) -> float:
        return _time_step(sess, fetches, feeds)


def logical_name(variable) -> str:
    """The single-device name of a variable or of the partitioned variable it is a part of."""
    info = tf_shim.save_slice_info(variable)  # TF's own record of partitioned variables' parts
    return info.full_name if info is not None else variable.op.name


@contextlib.contextmanager
def record_get_variable(names: set):
    """Remembers which variables come from get_variable (they accept a partitioner)."""
    def getter(getter, name, *args, **kwargs):  # TF passes the next getter as `getter`
        names.add(name)
        return getter(name, *args, **kwargs)
    with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(), custom_getter=getter):
        yield


def capture(model, input_fn: Optional[Callable], ctx: RunContext, seed: int,
            evaluate: bool = True, time_compute: bool = False, measures: Sequence = (),
            shard_input: bool = True, process: pool_threads.ProcessConfig = pool_threads.ProcessConfig()) -> Capture:
    """Builds the model's graph (`model`: a front end, or a model_fn); with `evaluate`, also runs
    its initialisers and one batch.
    `time_compute`: times a step; `measures`: a strategy's further measurements (Measure
    objects, parallax_tf.strategy), each given a CaptureView; `shard_input` (--shard_input):
    whether the tf.data pipelines model_fn builds may be sharded, each as input_shard decides;
    `process`: the pools and device its sessions run with."""
    front_end = front_end_lib.of(model)
    graph, training, from_get_variable = _build(front_end, ctx, seed, shard_input)
    inputs = input_shard.decide(training.inputs, lambda other: _build(front_end, other, seed, shard_input)[1].inputs)
    with graph.as_default():
        built = _model_parts(graph, training, from_get_variable)
        # input_fn runs on the evaluating rank only: a rank that reads no data (a Stanza FC node)
        # may have no batch to give
        feeds = make_feeds(input_fn, ctx, built.placeholders, graph) if evaluate else {}
        found = _evaluate(built, feeds, evaluate, time_compute, process)
        state_info = [StateInfo(name=name, shape=list(var.shape), dtype=var.dtype.base_dtype.name,
                                bytes=int(np.asarray(found.state_values[name]).nbytes),
                                per_rank=_reads_the_batch(var, training.train_op),
                                layer=_state_layer(var, training))
                      for name, var in built.state_vars.items()]
        forward = graph_walk.ancestors(training.loss.op)
    infos, initial = _describe_variables(built, found, forward)
    initial.update({name: np.asarray(value) for name, value in found.state_values.items()})
    initial.update(dynamic.start_values(graph))      # a dynamic layer's table goes on from its last run
    optimizers = sorted({type(a.optimizer).__name__ for a in training.applies})
    view = CaptureView(graph, training, built.groups, {i.name: i.layer for i in infos}, built.state_vars, feeds,
                       built.initializers, evaluate, time_compute, process)
    with graph.as_default():
        measured = {measure.name: measure.measure(view) for measure in measures}
        tables = [dict(table, ids_per_step=found.table_ids.get(table["name"]),
                       rows_at_start=len(initial.get(f"{table['name']}/ids", ())))
                  for table in dynamic.describe_tables(graph, training.applies)]
    return Capture(infos, initial, built.placeholders, "+".join(optimizers), found.compute_s, state_info,
                   training.global_step.op.name if training.global_step is not None else None, measured,
                   sorted(training.model.metrics or {}), tables, inputs,
                   front_end.dialect, front_end.traced)


def _build(front_end, ctx: RunContext, seed: int, shard_input: bool):
    """The front end's training graph in a graph of its own, as every rank builds it: (the graph,
    its training_record.Training, the names of the variables made by get_variable)."""
    graph = tf.Graph()
    from_get_variable: set = set()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        with record_get_variable(from_get_variable):
            training = front_end.build(ctx, shard=shard_input)
    return graph, training, from_get_variable


@dataclasses.dataclass
class _ModelParts:
    """What capture's steps read of the model built in the capture graph."""
    graph: tf.Graph
    training: object                        # training_record.Training
    placeholders: List[str]
    initializers: list
    groups: Dict[str, list]                 # logical name -> [(variable, raw gradient)]
    state_vars: Dict[str, tf.Variable]
    from_get_variable: set


@dataclasses.dataclass
class _Evaluated:
    """The capture graph's values (zeros where it is not evaluated) and what one batch showed."""
    values: Dict[str, list]                 # logical name -> its parts' values
    state_values: Dict[str, np.ndarray]
    rows: Dict[str, tuple]                  # _rows_touched
    compute_s: Optional[float]
    table_ids: Dict[str, int] = dataclasses.field(default_factory=dict)   # _table_ids


def _model_parts(graph, training, from_get_variable: set) -> _ModelParts:
    """The trainable variables (checked: the optimizers alone write them) with their raw
    gradients by single-device name, the model's state, and what a step needs fed and run first."""
    trainable = tf.compat.v1.trainable_variables()
    if not trainable:
        raise ModelError("model_fn created no trainable variables: there is nothing to train")
    _check_no_outside_writes(graph, trainable, training.created_by_optimizers())
    placeholders = graph_walk.needed_placeholders(training.train_op, training.loss)
    initializers = model_init.initializers(graph, [training.train_op])
    raw = training.raw_gradients()
    applied = training.applied()
    groups: Dict[str, list] = {}
    for var in trainable:
        grad = raw[var.op.name][0] if var.op.name in applied else None
        groups.setdefault(logical_name(var), []).append((var, grad))
    state_vars = _state_variables(training, trainable)
    return _ModelParts(graph, training, placeholders, initializers, groups, state_vars, from_get_variable)


def _evaluate(built: _ModelParts, feeds: dict, evaluate: bool, time_compute: bool,
              process: pool_threads.ProcessConfig) -> _Evaluated:
    """With `evaluate`, the initial values, the rows one batch touches and (`time_compute`) a
    step's time, from a session of the capture graph."""
    groups, state_vars = built.groups, built.state_vars
    values = {name: [np.zeros(v.shape, v.dtype.base_dtype.as_numpy_dtype) for v, _ in pairs]
              for name, pairs in groups.items()}
    state_values = {name: np.zeros(v.shape, v.dtype.base_dtype.as_numpy_dtype) for name, v in state_vars.items()}
    rows: Dict[str, tuple] = {}
    table_ids: Dict[str, int] = {}
    compute_s = None
    if evaluate:
        with tf.compat.v1.Session(graph=built.graph, config=process.proto()) as sess:
            _initialise(sess, built.initializers)
            values, state_values = sess.run(({name: [v for v, _ in pairs] for name, pairs in groups.items()},
                                             state_vars))
            rows = _rows_touched(sess, groups, feeds, graph_walk.ancestors(built.training.loss.op))
            table_ids = _table_ids(sess, built.graph, feeds)
            if time_compute:
                compute_s = _time_step(sess, [g for pairs in groups.values() for _, g in pairs if g is not None],
                                       feeds)
    return _Evaluated(values, state_values, rows, compute_s, table_ids)


def _describe_variables(built: _ModelParts, found: _Evaluated, forward: set) -> tuple:
    """(VariableInfo of every trainable variable, its whole initial value by single-device name)."""
    infos, initial = [], {}
    for name, pairs in built.groups.items():
        parts = [v for v, _ in pairs]
        whole = np.concatenate(found.values[name], axis=0) if len(parts) > 1 else found.values[name][0]
        initial[name] = whole
        kinds = {_gradient_kind(g) for _, g in pairs}
        gradient = "none" if kinds == {"none"} else ("sparse" if kinds == {"sparse"} else "dense")
        infos.append(VariableInfo(
            name=name, shape=list(whole.shape), dtype=parts[0].dtype.base_dtype.name,
            bytes=int(whole.nbytes), gradient=gradient,
            layer=_layer_kind(parts, gradient, built.training.keras_layers, forward),
            rows_touched=found.rows.get(name, (None, None))[0], gathered_bytes=found.rows.get(name, (None, None))[1],
            user_partitioned=len(parts) > 1 or tf_shim.save_slice_info(parts[0]) is not None,
            part_names=[p.op.name for p in parts], part_rows=[int(p.shape[0]) for p in parts] if whole.ndim else [],
            split_refusal=_split_refusal(name, parts, built),
            rows_each=any(p.op.name in built.training.rows_each for p in parts)))
    return infos, initial


def _split_refusal(name: str, parts, built: _ModelParts) -> str:
    """Why the toolkit cannot split a variable into row shards ("" when it can): a model_fn's
    only through get_variable's partitioner, a traced step's as its front end says."""
    refusals = built.training.split_refusals
    if refusals is None:
        return "" if name in built.from_get_variable else "created by tf.Variable (use get_variable to partition)"
    return refusals.get(parts[0].op.name, "")


def _initialise(sess, initializers) -> None:
    """What a single-device script runs before training: variables, local variables, tables,
    iterators (parallax_tf.model_init)."""
    sess.run([tf.compat.v1.global_variables_initializer(), tf.compat.v1.local_variables_initializer()])
    sess.run(initializers)


def _state_variables(training, trainable) -> Dict[str, tf.Variable]:
    """Non-trainable variables the model made (not the optimizers' slots and accumulators, not the
    global step), by single-device name."""
    skip = {v.op.name for v in trainable} | training.created_by_optimizers()
    if training.global_step is not None:
        skip.add(training.global_step.op.name)
    out = {}
    for var in tf.compat.v1.global_variables():
        if var.op.name not in skip:
            out[logical_name(var)] = var
    return out


def _reads_the_batch(var, train_op) -> bool:
    """Whether the train op updates `var` from this rank's data (then ranks' copies differ): the
    value it writes is computed from the input (an EMA of weights, written after the apply,
    depends on the batch by control only and is the same on every rank)."""
    target = training_record.storage(var).name
    needed = graph_walk.ancestors(train_op)
    for op in needed:
        if op.type in graph_walk.WRITE_OPS and op.inputs and op.inputs[0].name == target:
            if any(a.type in graph_walk.INPUT_OPS for a in graph_walk.ancestors(op, data_only=True)):
                return True
    return False


def _state_layer(var, training) -> str:
    keras = training.keras_layers.get(var.op.name)
    if keras in KERAS_LAYER_KINDS:
        return KERAS_LAYER_KINDS[keras]
    types = {op.type for op in _consumers(var)}
    return "norm" if types & _NORM_OPS else "state"


_storage = training_record.storage


def _check_no_outside_writes(graph, trainable, optimizer_ops: set) -> None:
    targets = {_storage(v).name: v for v in trainable}
    initializers = {v.initializer.name for v in trainable}
    for op in graph.get_operations():
        if op.type in graph_walk.WRITE_OPS and op.name not in initializers and op.name not in optimizer_ops \
                and op.inputs:
            var = targets.get(op.inputs[0].name)
            if var is not None:
                raise ModelError(f"variable {logical_name(var)!r} is changed outside the optimizer by op "
                                 f"{op.name!r} ({op.type}); parallax_tf cannot keep such writes consistent "
                                 "across ranks. Make it non-trainable (trainable=False) or remove the write")


def _gradient_kind(grad) -> str:
    if grad is None:
        return "none"
    return "sparse" if isinstance(grad, tf.IndexedSlices) else "dense"


def _rows_touched(sess, groups, feeds, forward: set) -> Dict[str, tuple]:
    """(distinct rows, bytes gathered) per sparse variable for one batch."""
    fetches = {}
    for name, pairs in groups.items():
        if all(isinstance(g, tf.IndexedSlices) for _, g in pairs):
            gathers = [op.outputs[0] for v, _ in pairs for op in _consumers(v) if op.type in _GATHER_OPS
                       and op in forward]
            gathered = [tf.cast(tf.size(t, out_type=tf.int64), tf.int64) * t.dtype.size for t in gathers]
            fetches[name] = (tf.add_n([tf.size(tf.unique(g.indices).y) for _, g in pairs]),
                             tf.add_n(gathered) if gathered else tf.constant(0, tf.int64))
    return {k: (int(v[0]), int(v[1])) for k, v in sess.run(fetches, feeds).items()} if fetches else {}


def _table_ids(sess, graph, feeds) -> Dict[str, int]:
    """Per dynamic table, the distinct ids one batch reads (summed over its lookups)."""
    counts = dynamic.id_counts(graph)
    return {name: int(count) for name, count in sess.run(counts, feeds).items()} if counts else {}


def _time_step(sess, grads, feeds, warmups: int = 2, repeats: int = 7) -> float:
    """Median CPU seconds (this process, all threads) of one forward+backward pass on one batch
    (no update: values stay): what the cost model's CPU terms need (ranks sharing cores pay the
    CPU, not the wall time of a multi-threaded step), and unlike the wall time not inflated
    when the capturing rank waits for a CPU quota or beside other ranks. The first runs
    allocate and pick kernels; a model's own tf.data pipeline with few batches may end sooner:
    then what ran is timed (at least one batch)."""
    import time
    tensors = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]
    times = []
    for _ in range(warmups + repeats):
        cpu_begin = time.process_time()
        try:
            sess.run(tensors, feeds)
        except tf.errors.OutOfRangeError:
            if not times:
                raise
            break
        times.append(time.process_time() - cpu_begin)
    timed = times[warmups:] or times[-1:]
    return sorted(timed)[len(timed) // 2]


def _consumers(variable):
    """Ops that use the variable's value, looking through reads, casts and loop plumbing."""
    return graph_walk.users(_storage(variable), graph_walk.WEIGHT_PASS_THROUGH_OPS, max_depth=6)


KERAS_LAYER_KINDS = {
    "Dense": "fully_connected", "EinsumDense": "fully_connected",
    "Conv1D": "conv", "Conv2D": "conv", "Conv3D": "conv", "Conv1DTranspose": "conv", "Conv2DTranspose": "conv",
    "Conv3DTranspose": "conv", "DepthwiseConv2D": "conv", "SeparableConv1D": "conv", "SeparableConv2D": "conv",
    "BatchNormalization": "norm", "LayerNormalization": "norm", "GroupNormalization": "norm",
    "Embedding": "embedding",
    "LSTM": "recurrent", "LSTMCell": "recurrent", "GRU": "recurrent", "GRUCell": "recurrent",
    "SimpleRNN": "recurrent", "SimpleRNNCell": "recurrent", "ConvLSTM2D": "recurrent", "ConvLSTM2DCell": "recurrent",
}
_COMBINING_OPS = _MATMUL_OPS | {"Mul", "Add", "AddV2", "BiasAdd"}
_SHAPING_OPS = graph_walk.WEIGHT_PASS_THROUGH_OPS | {"Slice", "StridedSlice", "ExpandDims", "Squeeze"}


def _layer_kind(parts, gradient: str, keras_layers: Dict[str, str], forward: set) -> str:
    """`forward`: the ops the loss depends on (the backward pass reuses weights too)."""
    keras = keras_layers.get(parts[0].op.name)
    if keras in KERAS_LAYER_KINDS:
        return KERAS_LAYER_KINDS[keras]
    ops = [op for p in parts for op in _consumers(p) if op in forward]
    types = {op.type for op in ops}
    if types & _GATHER_OPS and gradient == "sparse":
        gathers = [op for op in ops if op.type in _GATHER_OPS]
        return "softmax" if any(_feeds_output_layer(g, forward) for g in gathers) else "embedding"
    if types & _CONV_OPS:
        return "conv"
    if types & _NORM_OPS:
        return "norm"
    if types & {"While", "StatelessWhile"}:
        return "recurrent"          # captured by a while_loop body: an RNN cell
    if _reused_in_sequence([op for op in ops if op.type in _COMBINING_OPS]):
        return "recurrent"          # one weight applied step after step: a Python-unrolled RNN
    if types & _MATMUL_OPS:
        return "fully_connected"
    if "BiasAdd" in types or len(parts[0].shape) == 1:
        return "bias"
    return "other"


def _reused_in_sequence(ops) -> bool:
    """Several uses of one weight where a later use depends on an earlier one's result."""
    if len(ops) < 2:
        return False
    last = max(ops, key=tf_shim.creation_order)
    earlier = graph_walk.ancestors(last)
    return any(op in earlier for op in ops if op is not last)


def _feeds_output_layer(gather, forward: set) -> bool:
    """The gathered rows meet activations (a tensor computed through a MatMul or convolution)
    rather than another parameter: the rows are output-layer weights (sampled softmax), not an
    input embedding."""
    for op, tensor in graph_walk.reads_of(gather.outputs[0], _SHAPING_OPS, within=forward):
        if op.type in _COMBINING_OPS and any(_is_activation(t) for t in op.inputs if t is not tensor):
            return True
    return False


def _is_activation(tensor) -> bool:
    return any(op.type in _MATMUL_OPS | _CONV_OPS for op in graph_walk.ancestors(tensor.op))
