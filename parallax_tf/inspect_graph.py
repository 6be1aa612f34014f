"""inspect: build the user's single-device graph once and describe every trainable variable.

The capture graph is scratch: it is evaluated on rank 0's side to get the single-device initial
values (so any partitioning starts from exactly what a single device would) and to measure how
many rows of each sparse variable one real batch touches.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Callable, Dict, List, Optional

import numpy as np
import tensorflow as tf

from parallax_tf.errors import InputError, ModelError
from parallax_tf.model import Model, RunContext

_CONV_OPS = {"Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput", "Conv1D"}
_MATMUL_OPS = {"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"}
_GATHER_OPS = {"Gather", "GatherV2", "ResourceGather"}
_NORM_OPS = {"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "BatchNormWithGlobalNormalization"}
_PASS_THROUGH = {"Identity", "ReadVariableOp", "Cast", "Enter", "Switch", "Merge", "Reshape",
                 "ConcatV2", "Split", "SplitV", "Transpose"}
_WRITE_OPS = {"Assign", "AssignAdd", "AssignSub", "AssignVariableOp", "AssignAddVariableOp",
              "AssignSubVariableOp", "ScatterUpdate", "ScatterAdd", "ScatterSub", "ScatterMul",
              "ScatterDiv", "ScatterNdUpdate", "ScatterNdAdd", "ResourceScatterUpdate",
              "ResourceScatterAdd", "ResourceScatterSub", "ResourceScatterMul",
              "ResourceScatterDiv", "ResourceScatterNdUpdate", "ResourceScatterNdAdd"}


@dataclasses.dataclass
class VariableInfo:
    name: str                      # single-device (logical) name, without ":0"
    shape: List[int]
    dtype: str
    bytes: int
    gradient: str                  # sparse | dense | none
    layer: str
    rows_touched: Optional[int]    # unique rows one rank's batch touches (sparse only)
    gathered_bytes: Optional[int]  # bytes its lookups return for one batch, repeats included
    user_partitioned: bool
    part_names: List[str]          # the variables holding it in the capture graph
    part_rows: List[int]
    from_get_variable: bool        # only get_variable variables can be partitioned by us

    @property
    def row_bytes(self) -> int:
        return self.bytes // max(1, self.shape[0]) if self.shape else self.bytes


@dataclasses.dataclass
class Capture:
    variables: List[VariableInfo]
    initial_values: Dict[str, np.ndarray]   # logical name -> whole value
    placeholders: List[str]                 # placeholder names the loss needs fed
    optimizer_name: str
    compute_s: Optional[float] = None       # one single-device forward+backward, when timed


def call_model_fn(model_fn: Callable, ctx: RunContext) -> Model:
    """Calls model_fn() or model_fn(ctx) and checks what it returned."""
    try:
        takes_ctx = len(inspect.signature(model_fn).parameters) >= 1
    except (TypeError, ValueError):
        takes_ctx = False
    model = model_fn(ctx) if takes_ctx else model_fn()
    if not isinstance(model, Model):
        raise ModelError(f"model_fn returned {type(model).__name__}; return "
                         "parallax_tf.Model(loss=<scalar tensor>, optimizer=<tf.compat.v1.train optimizer>)")
    if model.loss is None:
        raise ModelError("model_fn returned no loss: pass Model(loss=<scalar tensor>, ...)")
    if model.optimizer is None:
        raise ModelError("model_fn returned no optimizer: pass Model(..., optimizer="
                         "tf.compat.v1.train.GradientDescentOptimizer(0.1)) or another v1 optimizer")
    if not isinstance(model.optimizer, tf.compat.v1.train.Optimizer):
        raise ModelError(f"optimizer is a {type(model.optimizer).__name__}; parallax_tf needs a "
                         "tf.compat.v1.train optimizer (GradientDescent, Momentum, Adagrad, Adam, ...)")
    if not isinstance(model.loss, tf.Tensor):
        raise ModelError(f"loss is a {type(model.loss).__name__}, not a tensor of the graph model_fn built")
    if model.loss.shape.rank != 0:
        raise ModelError(f"loss {model.loss.name} has shape {model.loss.shape}; it must be a scalar "
                         "(reduce it, e.g. tf.reduce_mean over the batch)")
    return model


def logical_name(variable) -> str:
    """The single-device name of a variable or of the partitioned variable it is a part of."""
    info = variable._get_save_slice_info()  # TF's own record of partitioned variables' parts
    return info.full_name if info is not None else variable.op.name


@contextlib.contextmanager
def record_get_variable(names: set):
    """Remembers which variables come from get_variable (they accept a partitioner)."""
    def getter(getter, name, *args, **kwargs):  # TF passes the next getter as `getter`
        names.add(name)
        return getter(name, *args, **kwargs)
    with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(), custom_getter=getter):
        yield


def capture(model_fn: Callable, input_fn: Optional[Callable], ctx: RunContext, seed: int,
            evaluate: bool = True, time_compute: bool = False) -> Capture:
    """Builds model_fn's graph; with `evaluate`, also runs its initialisers and one batch."""
    graph = tf.Graph()
    from_get_variable: set = set()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        with record_get_variable(from_get_variable):
            model = call_model_fn(model_fn, ctx)
        trainable = tf.compat.v1.trainable_variables()
        if not trainable:
            raise ModelError("model_fn created no trainable variables: there is nothing to train")
        _check_no_outside_writes(graph, trainable)
        placeholders = _needed_placeholders(model.loss)
        grads = tf.gradients(model.loss, trainable)
        groups: Dict[str, list] = {}
        for var, grad in zip(trainable, grads):
            groups.setdefault(logical_name(var), []).append((var, grad))
        feeds = make_feeds(input_fn, ctx, placeholders, graph)
        values = {name: [np.zeros(v.shape, v.dtype.base_dtype.as_numpy_dtype) for v, _ in pairs]
                  for name, pairs in groups.items()}
        rows: Dict[str, tuple] = {}
        compute_s = None
        if evaluate:
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run([tf.compat.v1.global_variables_initializer(),
                          tf.compat.v1.local_variables_initializer(), tf.compat.v1.tables_initializer()])
                values = sess.run({name: [v for v, _ in pairs] for name, pairs in groups.items()})
                rows = _rows_touched(sess, groups, feeds)
                if time_compute:
                    compute_s = _time_step(sess, [g for g in grads if g is not None], feeds)
    infos, initial = [], {}
    for name, pairs in groups.items():
        parts = [v for v, _ in pairs]
        whole = np.concatenate(values[name], axis=0) if len(parts) > 1 else values[name][0]
        initial[name] = whole
        kinds = {_gradient_kind(g) for _, g in pairs}
        gradient = "none" if kinds == {"none"} else ("sparse" if kinds == {"sparse"} else "dense")
        infos.append(VariableInfo(
            name=name, shape=list(whole.shape), dtype=parts[0].dtype.base_dtype.name,
            bytes=int(whole.nbytes), gradient=gradient, layer=_layer_kind(parts, gradient),
            rows_touched=rows.get(name, (None, None))[0], gathered_bytes=rows.get(name, (None, None))[1],
            user_partitioned=len(parts) > 1 or parts[0]._get_save_slice_info() is not None,
            part_names=[p.op.name for p in parts], part_rows=[int(p.shape[0]) for p in parts] if whole.ndim else [],
            from_get_variable=name in from_get_variable))
    return Capture(infos, initial, placeholders, type(model.optimizer).__name__, compute_s)


def make_feeds(input_fn, ctx: RunContext, placeholders: List[str], graph) -> dict:
    """input_fn(ctx) -> {placeholder name: value}; checks it covers every needed placeholder."""
    if input_fn is None:
        if placeholders:
            raise InputError(f"the loss needs placeholders {placeholders} fed but no input_fn was given; "
                             "pass input_fn(ctx) returning {name: batch}")
        return {}
    batch = input_fn(ctx)
    if not isinstance(batch, dict):
        raise InputError(f"input_fn returned {type(batch).__name__}; return a dict {{placeholder name: batch}}")
    missing = [p for p in placeholders if p not in batch]
    if missing:
        raise InputError(f"input_fn did not provide placeholder(s) {missing}; it returned keys "
                         f"{sorted(batch)}. Add them to the dict input_fn returns")
    feeds = {}
    for key, value in batch.items():
        try:
            feeds[graph.get_tensor_by_name(key if ":" in key else key + ":0")] = value
        except (KeyError, ValueError):
            raise InputError(f"input_fn returned key {key!r} but the graph has no placeholder of that name; "
                             f"placeholders the loss needs: {placeholders}") from None
    return feeds


def _needed_placeholders(loss) -> List[str]:
    seen, stack, found = set(), [loss.op], []
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        if op.type == "Placeholder":
            found.append(op.name)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return sorted(found)


def _storage(variable) -> tf.Tensor:
    """The tensor ops use to reach a variable: its resource handle, or a ref variable's ref."""
    handle = getattr(variable, "handle", None)
    return handle if handle is not None and handle.dtype == tf.resource else variable.op.outputs[0]


def _check_no_outside_writes(graph, trainable) -> None:
    targets = {_storage(v).name: v for v in trainable}
    initializers = {v.initializer.name for v in trainable}
    for op in graph.get_operations():
        if op.type in _WRITE_OPS and op.name not in initializers and op.inputs:
            var = targets.get(op.inputs[0].name)
            if var is not None:
                raise ModelError(f"variable {logical_name(var)!r} is changed outside the optimizer by op "
                                 f"{op.name!r} ({op.type}); parallax_tf cannot keep such writes consistent "
                                 "across ranks. Make it non-trainable (trainable=False) or remove the write")


def _gradient_kind(grad) -> str:
    if grad is None:
        return "none"
    return "sparse" if isinstance(grad, tf.IndexedSlices) else "dense"


def _rows_touched(sess, groups, feeds) -> Dict[str, tuple]:
    """(distinct rows, bytes gathered) per sparse variable for one batch."""
    fetches = {}
    for name, pairs in groups.items():
        if all(isinstance(g, tf.IndexedSlices) for _, g in pairs):
            gathers = [op.outputs[0] for v, _ in pairs for op in _consumers(v) if op.type in _GATHER_OPS]
            gathered = [tf.cast(tf.size(t, out_type=tf.int64), tf.int64) * t.dtype.size for t in gathers]
            fetches[name] = (tf.add_n([tf.size(tf.unique(g.indices).y) for _, g in pairs]),
                             tf.add_n(gathered) if gathered else tf.constant(0, tf.int64))
    return {k: (int(v[0]), int(v[1])) for k, v in sess.run(fetches, feeds).items()} if fetches else {}


def _time_step(sess, grads, feeds, repeats: int = 3) -> float:
    """Median wall time of one forward+backward pass on one batch (no update: values stay)."""
    import time
    tensors = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]
    sess.run(tensors, feeds)
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        sess.run(tensors, feeds)
        times.append(time.perf_counter() - begin)
    return sorted(times)[len(times) // 2]


def _consumers(variable):
    """Ops that use the variable's value, looking through reads, casts and loop plumbing."""
    frontier, seen, found = [_storage(variable)], set(), []
    for _ in range(6):
        nxt = []
        for tensor in frontier:
            for op in tensor.consumers():
                if op.name in seen:
                    continue
                seen.add(op.name)
                if op.type in _PASS_THROUGH:
                    nxt.extend(op.outputs)
                else:
                    found.append(op)
        frontier = nxt
    return found


def _layer_kind(parts, gradient: str) -> str:
    ops = [op for p in parts for op in _consumers(p)]
    types = {op.type for op in ops}
    if types & _GATHER_OPS and gradient == "sparse":
        return "embedding"
    if types & _CONV_OPS:
        return "conv"
    if types & _NORM_OPS:
        return "norm"
    if types & {"While", "StatelessWhile"}:
        return "recurrent"          # captured by a while_loop body: an RNN cell
    if types & _MATMUL_OPS:
        return "fully_connected"
    if "BiasAdd" in types or len(parts[0].shape) == 1:
        return "bias"
    return "other"
