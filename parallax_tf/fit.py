"""ptf.fit: a tf_keras compile/fit script on many ranks (a first version: fit's docstring says what it takes).

The compiled model is rebuilt inside the toolkit's model_fn from its config, every variable
starting from the eager model's own value; compile's optimizer becomes the legacy one with the
same hyperparameters (the new Keras optimizers update nothing in a v1 graph); compile's loss is
computed as Keras computes it (per output: the loss of each example, summed and divided by the
number of loss elements of the *global* batch, times loss_weights; plus the model's
regularisation losses). Each global batch of `batch_size` rows is split over
the data ranks in order (np.array_split), and each rank's loss is scaled so that the mean over
ranks of the ranks' gradients is single-device Keras' gradient on the whole batch, also for an
uneven last batch.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional

import numpy as np
import tensorflow as tf

from parallax_tf.errors import ConfigError, ModelError
from parallax_tf.model import Model

GLOBAL_ROWS = "parallax_fit_global_rows"      # placeholder: the rows of this step's global batch
# Arguments of tf_keras.Model.fit this version does not take yet (each refused with one line)
NOT_YET = ("callbacks", "validation_split", "validation_data", "class_weight", "sample_weight", "steps_per_epoch",
           "validation_steps", "initial_epoch")


class KerasSpec:
    """What the single-device script compiled: how to rebuild the model, its starting weights and
    compile's choices."""

    def __init__(self, model):
        import tf_keras
        self.builder: Optional[Callable] = None
        if not isinstance(model, tf_keras.Model) and callable(model):
            self.builder, model = model, model()
        if not isinstance(model, tf_keras.Model):
            raise ModelError(f"ptf.fit takes a compiled tf_keras model or a function returning one; got "
                             f"{type(model).__name__}")
        if not getattr(model, "_is_compiled", False):
            raise ModelError("ptf.fit needs a compiled model: call model.compile(optimizer=..., loss=...) first")
        self.model = model
        self.compiled = dict(model._compile_config.config)     # compile's own arguments (tf_keras private)
        self.weights = {_name(w): w.numpy() for w in model.weights}
        self.input_names = list(model.input_names)
        self.output_names = list(model.output_names)
        self._optimizer = _legacy_optimizer(self.compiled.get("optimizer") or "rmsprop")

    def rebuild(self):
        """The model again, in the current (graph-mode) graph, each variable starting from the
        eager model's value."""
        import tf_keras

        def creator(next_creator, **kwargs):
            scope = tf.compat.v1.get_default_graph().get_name_scope()
            name = f"{scope}/{kwargs.get('name')}" if scope else kwargs.get("name")
            if name in self.weights:
                kwargs["initial_value"] = self.weights[name]
            return next_creator(**kwargs)
        with tf.variable_creator_scope(creator):
            if self.builder is not None:
                return self.builder()
            return tf_keras.models.clone_model(self.model)

    def optimizer(self):
        """compile's optimizer as a fresh legacy tf_keras optimizer of the same class and settings
        (a new one per model_fn call: an optimizer belongs to one graph)."""
        made = self._optimizer
        return made if isinstance(made, tf.compat.v1.train.Optimizer) else made.__class__.from_config(made.get_config())


def _legacy_optimizer(chosen):
    """The legacy optimizer equivalent to compile's `optimizer` (read eagerly, as the new
    optimizers' settings can only be)."""
    import tf_keras
    if isinstance(chosen, str):
        return tf_keras.optimizers.get(chosen, use_legacy_optimizer=True)
    if isinstance(chosen, (tf_keras.optimizers.legacy.Optimizer, tf.compat.v1.train.Optimizer)):
        return chosen
    return tf_keras.__internal__.optimizers.convert_to_legacy_optimizer(chosen)


def _name(variable) -> str:
    return variable.name.split(":")[0]


def _per_output(value, names: List[str], what: str) -> Dict[str, object]:
    """compile's loss or loss_weights, one per output name."""
    if isinstance(value, dict):
        missing = [n for n in names if n not in value]
        if missing:
            raise ModelError(f"compile's {what} has no entry for output(s) {missing}")
        return {n: value[n] for n in names}
    if isinstance(value, (list, tuple)):
        if len(value) != len(names):
            raise ModelError(f"compile's {what} has {len(value)} entries for {len(names)} outputs")
        return dict(zip(names, value))
    return {n: value for n in names}


def _loss_sum(loss, y_true, y_pred):
    """The sum of one output's per-example losses (Keras: the loss function's value for each
    example, the last axis reduced by the function itself), and how many elements they are per row."""
    import tf_keras
    function = tf_keras.losses.get(loss)
    values = function.call(y_true, y_pred) if isinstance(function, tf_keras.losses.Loss) else function(y_true, y_pred)
    per_row = int(np.prod(values.shape[1:])) if values.shape.rank and values.shape.rank > 1 else 1
    return tf.reduce_sum(tf.cast(values, tf.float32)), per_row


def _metric_objects(spec: KerasSpec, target, output, name: str) -> list:
    """compile's metrics for one output as tf_keras Metric objects, resolved as Keras resolves
    them ('accuracy' and 'crossentropy' by the shapes of the target and the output)."""
    import tf_keras
    chosen = spec.compiled.get("metrics") or []
    if isinstance(chosen, dict):
        chosen = chosen.get(name) or []
    chosen = chosen if isinstance(chosen, (list, tuple)) else [chosen]
    found = []
    for metric in chosen:
        if isinstance(metric, str) and metric.lower() in ("accuracy", "acc", "crossentropy", "ce"):
            binary = output.shape[-1] == 1
            sparse = target.shape.rank < output.shape.rank or target.shape[-1] == 1 and not binary
            kind = "binary" if binary else ("sparse_categorical" if sparse else "categorical")
            suffix = "accuracy" if metric.lower() in ("accuracy", "acc") else "crossentropy"
            metric = tf_keras.metrics.MeanMetricWrapper(tf_keras.metrics.get(f"{kind}_{suffix}"), name=metric)
        elif not isinstance(metric, tf_keras.metrics.Metric):
            function = tf_keras.metrics.get(metric)
            metric = function if isinstance(function, tf_keras.metrics.Metric) else \
                tf_keras.metrics.MeanMetricWrapper(function, name=metric if isinstance(metric, str) else
                                                   getattr(function, "__name__", "metric"))
        else:
            metric = metric.__class__.from_config(metric.get_config())    # a fresh one in this graph
        found.append(metric)
    return found


def _state_increment(metric, target, output):
    """The metric's state after this step's update from zero: its share of the epoch's state
    (every Keras metric's state adds up: counts, sums, confusion matrices)."""
    zero = tf.group(*[v.assign(tf.zeros_like(v)) for v in metric.variables])
    with tf.control_dependencies([zero]):
        update = metric.update_state(target, output)
    with tf.control_dependencies([update] if update is not None else []):
        return tf.concat([tf.reshape(tf.cast(v.read_value(), tf.float64), [-1]) for v in metric.variables], 0)


def fit_model_fn(spec: KerasSpec, targets: Dict[str, np.ndarray], ranks_reading: Callable[[object], int],
                 built_metrics: Optional[dict] = None):
    """The model_fn that trains the compiled model: inputs and targets are placeholders named
    after the model's inputs and `<output>_target` (shaped and typed as the arrays `targets`)."""
    def model_fn(ctx):
        net = spec.rebuild()
        outputs = net.outputs if len(net.outputs) > 1 else [net.outputs[0]]
        losses = _per_output(spec.compiled.get("loss"), spec.output_names, "loss")
        weights = _per_output(spec.compiled.get("loss_weights") or 1.0, spec.output_names, "loss_weights")
        global_rows = tf.compat.v1.placeholder(tf.float32, [], name=GLOBAL_ROWS)
        scale = float(ranks_reading(ctx)) / global_rows     # each rank's share of the global mean
        total, increments = [], {}
        for name, output in zip(spec.output_names, outputs):
            array = targets[f"{name}_target"]
            target = tf.compat.v1.placeholder(tf.as_dtype(array.dtype), [None] + list(array.shape[1:]),
                                              name=f"{name}_target")
            summed, per_row = _loss_sum(losses[name], target, output)
            total.append(weights[name] * summed * scale / per_row)
            for metric in _metric_objects(spec, target, output, name):
                key = metric.name if len(outputs) == 1 else f"{name}_{metric.name}"
                increments[key] = _state_increment(metric, target, output)
                if built_metrics is not None:     # how to read an epoch's summed state (eagerly)
                    built_metrics[key] = None if _is_mean(metric) else (type(metric), metric.get_config())
        regularisation = tf.add_n([tf.cast(l, tf.float32) for l in net.losses]) if net.losses else 0.0
        return Model(loss=tf.add_n(total) + regularisation, optimizer=spec.optimizer(), metrics=increments)
    return model_fn


def _named_arrays(value, names: List[str], what: str) -> Dict[str, np.ndarray]:
    if isinstance(value, dict):
        missing = [n for n in names if n not in value]
        if missing:
            raise ConfigError(f"fit's {what} has no array for {missing}; its keys are {sorted(value)}")
        return {n: np.asarray(value[n]) for n in names}
    if isinstance(value, (list, tuple)) and len(names) > 1:
        return {n: np.asarray(v) for n, v in zip(names, value)}
    return {names[0]: np.asarray(value)}


def fit(model, x=None, y=None, batch_size=None, epochs=1, verbose="auto", shuffle=True, seed: int = 0, **options):
    """Trains a compiled tf_keras model as `model.fit(x, y, batch_size, epochs, shuffle=...)`
    would on one device, on every rank of the job; `batch_size` is the global batch. Returns a
    tf_keras History whose `model` holds the trained weights.

    Built so far: NumPy (or dict of NumPy) x and y, epochs, shuffle (one seeded permutation per
    epoch, the same on every rank), compile's optimizer, loss, loss_weights and metrics (each
    epoch's over the whole global batch: a stateful metric such as AUC sums its state over steps
    and ranks). Not yet: validation, callbacks, tf.data input, sample and class weights, resume at
    an epoch."""
    from parallax_tf.api import run
    import tf_keras
    given = sorted(k for k in options if k in NOT_YET and options[k] not in (None, 0, 0.0))
    unknown = sorted(k for k in options if k not in NOT_YET)
    if given or unknown:
        raise ConfigError(f"ptf.fit does not take {given + unknown} yet; it trains x and y for `epochs` epochs")
    spec = KerasSpec(model)
    inputs = _named_arrays(x, spec.input_names, "x")
    targets = {f"{n}_target": a for n, a in _named_arrays(y, spec.output_names, "y").items()}
    rows = len(next(iter(inputs.values())))
    batch_size = batch_size or 32
    per_epoch = math.ceil(rows / batch_size)
    orders = [np.random.RandomState(seed + epoch).permutation(rows) if shuffle else np.arange(rows)
              for epoch in range(epochs)]

    def global_batch(step: int) -> np.ndarray:
        epoch, batch = divmod(step, per_epoch)
        return orders[epoch][batch * batch_size:(batch + 1) * batch_size]

    def input_fn(ctx):
        chosen = global_batch(ctx.step)
        mine = np.array_split(chosen, ctx.size)[ctx.rank]
        feeds = {name: array[mine] for name, array in {**inputs, **targets}.items()}
        feeds[GLOBAL_ROWS] = np.float32(len(chosen))
        return feeds

    built_metrics: dict = {}
    result = run(fit_model_fn(spec, targets, lambda ctx: ctx.size, built_metrics), input_fn, steps=epochs * per_epoch)
    history = tf_keras.callbacks.History()
    history.set_model(spec.model)
    if result.plan_only:
        history.plan = result.plan
        return history
    spec.model.set_weights([result.variables[_name(w)] for w in spec.model.weights])
    _fill_history(history, result, built_metrics, [len(global_batch(s)) for s in range(epochs * per_epoch)],
                  per_epoch)
    history.plan = result.plan
    return history


def _fill_history(history, result, built_metrics: dict, rows: List[int], per_epoch: int) -> None:
    """History's epochs and values as Keras keeps them, for the epochs this call trained (a run
    resumed from a checkpoint starts at result.start_step): the loss is the mean of the batches'
    losses weighted by their rows; a metric's value comes from its state summed over the epoch."""
    first = result.start_step
    trained = range(first, first + len(result.mean_losses))
    epochs = sorted({step // per_epoch for step in trained})
    history.epoch = epochs
    history.history = {"loss": []}
    for epoch in epochs:
        steps = [s for s in range(epoch * per_epoch, (epoch + 1) * per_epoch) if s in trained]
        history.history["loss"].append(float(np.average([result.mean_losses[s - first] for s in steps],
                                                        weights=[rows[s] for s in steps])))
        for key, remake in built_metrics.items():
            state = result.plan.num_ranks * np.sum([result.metrics[key][s - first] for s in steps], 0)
            history.history.setdefault(key, []).append(_result_of(remake, state))


def _is_mean(metric) -> bool:
    """A mean (MeanMetricWrapper: accuracy, a loss as a metric, a function): state [total, count]."""
    import tf_keras
    return isinstance(metric, tf_keras.metrics.Mean)


def _result_of(remake, state: np.ndarray) -> float:
    """A metric's result for a whole epoch's state, summed over its steps and ranks: a mean's
    total / count, else the result of a copy of the metric (class, config) holding the state."""
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
