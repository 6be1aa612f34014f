"""The training graph of a compiled model: compile's loss over the global batch and each
metric's state from this step, as the toolkit's Model.

Keras computes an output's loss as the sum of each example's (sample-weighted) loss divided by
the number of loss elements of the batch, times loss_weights, plus the model's regularisation
losses. Each rank here holds a slice of the global batch and divides by the *global* batch's
elements, times the number of ranks that read data: the mean over ranks of the ranks' gradients
is then single-device Keras' gradient on the whole batch, also for an uneven last batch.

Where the strategy computes the loss once over the ranks' batches joined (ctx.batch_joined:
stanza's FC node), the loss is Keras' own mean over the rows the graph sees, and each metric's
state is divided by those rows: the strategy weights both by the rows and sums them over ranks,
and an epoch's end multiplies each step's state back by its global batch (EpochEnds)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional

import numpy as np
import tensorflow as tf

from parallax_tf.compat import tf_keras as keras_shim
from parallax_tf.fit.spec import KerasSpec, metric_list
from parallax_tf.model import Model

GLOBAL_ROWS = "parallax_fit_global_rows"      # placeholder: the rows of this step's global batch


@dataclasses.dataclass
class BuiltMetrics:
    """What fit_model_fn built, for the epoch ends: how to read each metric's summed state
    (metric_result), and whether the steps report it per row of their global batch."""
    remakes: Dict[str, object] = dataclasses.field(default_factory=dict)
    per_row: bool = False


# The toolkit's placeholders for targets and weights, named apart from tf_keras' own: a model
# built and compiled by the script's function inside the toolkit's graph makes `{output}_target`
# placeholders of its own.
def target_name(output: str) -> str:
    return f"parallax_fit_{output}_target"


def weight_feed_name(output: str) -> str:
    return f"parallax_fit_{output}_sample_weight"


def fit_model_fn(spec: KerasSpec, first_batch: Dict[str, np.ndarray], ranks_reading: Callable[[object], int],
                 built_metrics: Optional[BuiltMetrics] = None):
    """The model_fn that trains the compiled model. Targets and sample weights are placeholders
    named target_name(output) and weight_feed_name(output), shaped and typed as in
    `first_batch` (weights only when it has them). `built_metrics` is filled in as the graph is built."""
    def model_fn(ctx):
        with spec.rebuild() as net:
            inputs = {n: _placeholder(first_batch[n], n) for n in spec.input_names} if spec.subclassed else {}
            outputs = spec.call_on(net, inputs)
        losses = spec.per_output("loss")
        loss_weights = spec.per_output("loss_weights", 1.0)
        global_rows = tf.compat.v1.placeholder(tf.float32, [], name=GLOBAL_ROWS)
        rows_seen = tf.cast(tf.shape(outputs[0])[0], tf.float32)
        # Keras' mean over the rows seen, or this rank's share of the global batch's mean
        scale = 1.0 / rows_seen if ctx.batch_joined else float(ranks_reading(ctx)) / global_rows
        if built_metrics is not None:
            built_metrics.per_row = ctx.batch_joined
        total, increments = [], {}
        for name, output in zip(spec.output_names, outputs):
            given = _placeholder(first_batch[target_name(name)], target_name(name))
            weight = first_batch.get(weight_feed_name(name))
            weight = None if weight is None else _placeholder(weight, weight_feed_name(name))
            target, output, weight = _matched(given, output, weight)
            summed, per_row = _loss_sum(losses[name], target, output, weight)
            total.append(loss_weights[name] * summed * scale / per_row)
            if len(outputs) > 1:     # Keras' `{output}_loss`: a mean of the batches' losses weighted by rows
                increments[f"{name}_loss"] = tf.cast(tf.stack([summed / per_row, rows_seen]), tf.float64)
                if built_metrics is not None:
                    built_metrics.remakes[f"{name}_loss"] = None
            for metric, weighted in _metric_objects(spec, given, output, name):
                key = metric.name if len(outputs) == 1 else f"{name}_{metric.name}"
                key = f"weighted_{key}" if weighted and key in increments else key    # Keras' name for it
                increments[key] = _state_increment(metric, target, output, weight if weighted else None)
                if built_metrics is not None:
                    built_metrics.remakes[key] = None if _is_mean(metric) else (type(metric), metric.get_config())
        if ctx.batch_joined:
            increments = {key: state / tf.cast(rows_seen, tf.float64) for key, state in increments.items()}
        regularisation = tf.add_n([tf.cast(l, tf.float32) for l in net.losses]) if net.losses else 0.0
        return Model(loss=tf.add_n(total) + regularisation, optimizer=spec.optimizer(), metrics=increments)
    return model_fn


def _placeholder(array: np.ndarray, name: str):
    return tf.compat.v1.placeholder(tf.as_dtype(array.dtype), [None] + list(array.shape[1:]), name=name)


def _matched(target, output, weight):
    """Target and weight as tf_keras' compile matches them to an output (compile_utils'
    match_dtype_and_rank): labels of shape (N,) for an output of (N, k) gain a last axis, and take
    the output's dtype where both are floats or both integers; weights take the output's dtype."""
    if target.shape.rank == 1 and output.shape.rank == 2:
        target = tf.expand_dims(target, -1)
    if weight is not None and weight.shape.rank == 1 and output.shape.rank == 2:
        weight = tf.expand_dims(weight, -1)
    if (target.dtype.is_floating and output.dtype.is_floating) or (target.dtype.is_integer and output.dtype.is_integer):
        target = tf.cast(target, output.dtype)
    if weight is not None:
        weight = tf.cast(weight, output.dtype)
    return target, output, weight


def _loss_sum(loss, y_true, y_pred, weight):
    """The sum of one output's (weighted) per-example losses (the loss function's value for each
    example, its last axis reduced by the function itself), and how many elements they are per row.
    A loss given as a function is wrapped as compile wraps it (LossFunctionWrapper), which squeezes
    or expands the target to the output's rank."""
    import tf_keras
    function = tf_keras.losses.get(loss)
    if not isinstance(function, tf_keras.losses.Loss):
        function = keras_shim.loss_function_wrapper(function)
    values = function.call(y_true, y_pred)
    values = tf.cast(values, tf.float32)
    if weight is not None:       # broadcast over the elements of a row, as Keras' weighted loss does
        weight = tf.reshape(tf.cast(weight, tf.float32), [-1] + [1] * (values.shape.rank - 1))
        values = values * weight
    per_row = int(np.prod(values.shape[1:])) if values.shape.rank and values.shape.rank > 1 else 1
    return tf.reduce_sum(values), per_row


def _metric_objects(spec: KerasSpec, target, output, name: str) -> list:
    """(tf_keras Metric, weighted) for compile's metrics and weighted_metrics of one output,
    resolved as Keras resolves them ('accuracy' and 'crossentropy' by the target's and the
    output's shapes)."""
    found = []
    for weighted, chosen in ((False, spec.compiled.get("metrics")), (True, spec.compiled.get("weighted_metrics"))):
        for metric in metric_list(chosen, name):
            found.append((_metric_object(metric, target, output), weighted))
    return found


def _metric_object(metric, target, output):
    import tf_keras
    if isinstance(metric, str) and metric.lower() in ("accuracy", "acc", "crossentropy", "ce"):
        binary = output.shape[-1] == 1
        sparse = target.shape.rank < output.shape.rank or target.shape[-1] == 1 and not binary
        kind = "binary" if binary else ("sparse_categorical" if sparse else "categorical")
        suffix = "accuracy" if metric.lower() in ("accuracy", "acc") else "crossentropy"
        return tf_keras.metrics.MeanMetricWrapper(tf_keras.metrics.get(f"{kind}_{suffix}"), name=metric)
    if isinstance(metric, tf_keras.metrics.Metric):
        return metric.__class__.from_config(metric.get_config())    # a fresh one in this graph
    function = tf_keras.metrics.get(metric)
    if isinstance(function, tf_keras.metrics.Metric):
        return function
    return tf_keras.metrics.MeanMetricWrapper(
        function, name=metric if isinstance(metric, str) else getattr(function, "__name__", "metric"))


def _state_increment(metric, target, output, weight):
    """The metric's state after this step's update from zero: its share of the epoch's state
    (every Keras metric's state adds up: counts, sums, confusion matrices)."""
    zero = tf.group(*[v.assign(tf.zeros_like(v)) for v in metric.variables])
    with tf.control_dependencies([zero]):
        update = metric.update_state(target, output, sample_weight=weight)
    with tf.control_dependencies([update] if update is not None else []):
        return tf.concat([tf.reshape(tf.cast(v.read_value(), tf.float64), [-1]) for v in metric.variables], 0)


def _is_mean(metric) -> bool:
    """A mean (MeanMetricWrapper: accuracy, a loss as a metric, a function): state [total, count]."""
    import tf_keras
    return isinstance(metric, tf_keras.metrics.Mean)


def metric_result(remake, state: np.ndarray) -> float:
    """A metric's result for a whole epoch's state, summed over its steps and ranks: a mean's
    total / count, else the result of a copy of the metric (class, config) holding the state."""
    state = np.atleast_1d(state)
    if remake is None:
        return float(state[0] / state[1]) if state[1] else 0.0
    kind, config = remake
    metric = kind.from_config(config)
    at = 0
    for variable in metric.variables:
        size = int(np.prod(variable.shape))
        variable.assign(state[at:at + size].reshape(variable.shape).astype(variable.dtype.as_numpy_dtype))
        at += size
    return float(metric.result())
