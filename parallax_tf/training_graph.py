"""Building the user's single-device training graph and recording how it trains.

model_fn returns Model(loss, optimizer) or Model(loss, train_op). Either way the graph ends up
holding the user's own training ops: a gradient computation, any transform of the gradients,
one or more tf.compat.v1.train optimizer applies and perhaps a global-step increment. While
model_fn (and, for the optimizer form, `minimize`) runs, `build` records every gradient
computation and every `apply_gradients` call, so the later stages know which optimizer updates
which variable from which raw gradient, what lies between the two (the transform) and which
variable is the global step. Recording wraps two TF functions for the duration of the call
only and restores them afterwards; nothing stays patched.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Dict, List, Optional

import tensorflow as tf

from parallax_tf import input_shard
from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.errors import ModelError
from parallax_tf.keras_support import (creating_layer, describe_optimizer, is_legacy_keras_optimizer,
                                       keras_constants_stay_in_the_graph, legacy_keras_optimizer_class,
                                       new_keras_optimizer_class)
from parallax_tf.graph_walk import ancestors, needed_placeholders
from parallax_tf.model import Model, RunContext, check_metrics, check_predictions
from parallax_tf.training_record import Apply, GradientCall, Training

# The collection Model.init_op is recorded in (parallax_tf.model_init runs the initializers in it).
MODEL_INIT_OPS = "parallax_model_init_ops"

OPTIMIZER_FORM_HELP = ("return parallax_tf.Model(loss=<scalar tensor>, optimizer=<tf.compat.v1.train optimizer>) "
                       "or parallax_tf.Model(loss=<scalar tensor>, train_op=opt.minimize(loss, global_step=...))")


class _Recorder:
    def __init__(self, variable_hook):
        self.gradient_calls: List[GradientCall] = []
        self.applies: List[Apply] = []
        self.in_apply: List[object] = []
        self.keras_layers: Dict[str, str] = {}
        self.keras_layer_objects: list = []
        self.new_keras_optimizers: list = []     # new-Keras optimizers whose apply_gradients model_fn called
        self.variable_hook = variable_hook

    @contextlib.contextmanager
    def recording(self):
        helper = tf_shim.gradients_helper()
        optimizer_class = tf.compat.v1.train.Optimizer
        apply = optimizer_class.apply_gradients
        keras_class = legacy_keras_optimizer_class()
        keras_apply = keras_class.apply_gradients if keras_class is not None else None
        new_class = new_keras_optimizer_class()
        new_apply = new_class.apply_gradients if new_class is not None else None
        tf_shim.set_gradients_helper(self._recorded_gradients(helper))
        optimizer_class.apply_gradients = self._recorded_apply(apply)
        if keras_class is not None:
            keras_class.apply_gradients = self._recorded_keras_apply(keras_apply)
        if new_class is not None:
            new_class.apply_gradients = self._noted_new_keras_apply(new_apply)
        try:
            with tf.variable_creator_scope(self._create_variable), keras_constants_stay_in_the_graph():
                yield
        finally:
            tf_shim.set_gradients_helper(helper)
            optimizer_class.apply_gradients = apply
            if keras_class is not None:
                keras_class.apply_gradients = keras_apply
            if new_class is not None:
                new_class.apply_gradients = new_apply

    def _recorded_gradients(self, helper):
        """TF's gradients helper (tf.gradients, compute_gradients), recording each call."""
        def gradients_helper(ys, xs, grad_ys=None, *args, **kwargs):
            grads = helper(ys, xs, grad_ys, *args, **kwargs)
            self.gradient_calls.append(GradientCall(_as_list(ys), grad_ys, _as_list(xs), list(grads)))
            return grads
        return gradients_helper

    def _recorded_apply(self, apply):
        """tf.compat.v1.train.Optimizer.apply_gradients, recording each call."""
        def apply_gradients(optimizer, grads_and_vars, global_step=None, name=None, **kwargs):
            return self.record_apply(lambda pairs: apply(optimizer, pairs, global_step, name, **kwargs),
                                     optimizer, grads_and_vars, global_step)
        return apply_gradients

    def _recorded_keras_apply(self, keras_apply):
        """tf_keras' legacy OptimizerV2.apply_gradients, recording each call."""
        def keras_apply_gradients(optimizer, grads_and_vars, name=None, experimental_aggregate_gradients=True):
            # Aggregating over the replicas of the graph's (default) distribution strategy is an
            # identity that ties every gradient to every other (one IdentityN): left out, the
            # math is the same and each gradient stays its variable's own.
            return self.record_apply(lambda pairs: keras_apply(optimizer, pairs, name, False),
                                     optimizer, grads_and_vars, None)
        return keras_apply_gradients

    def _noted_new_keras_apply(self, new_apply):
        """tf_keras' new Optimizer.apply_gradients, noting the optimizer."""
        def new_apply_gradients(optimizer, *args, **kwargs):
            self.new_keras_optimizers.append(optimizer)     # it trains nothing here: named if no apply is found
            return new_apply(optimizer, *args, **kwargs)
        return new_apply_gradients

    def _create_variable(self, next_creator, **kwargs):
        """The variable creator: the hook (or TF) creates it; the tf_keras layer making it is noted."""
        layer = creating_layer()
        if self.variable_hook is not None:
            var = self.variable_hook(next_creator, kwargs, in_apply=bool(self.in_apply))
        else:
            var = next_creator(**kwargs)
        if layer is not None:
            self.keras_layers[var.op.name] = type(layer).__name__
            if not any(layer is seen for seen in self.keras_layer_objects):
                self.keras_layer_objects.append(layer)
        return var

    def record_apply(self, apply, optimizer, grads_and_vars, global_step):
        """Runs `apply(pairs)` (an optimizer's apply_gradients) and records what it created. A
        tf_keras optimizer advances its own `iterations`: that is the step it counts."""
        grads_and_vars = tuple(grads_and_vars)
        graph = tf.compat.v1.get_default_graph()
        before = len(graph.get_operations())
        self.in_apply.append(optimizer)
        try:
            op = apply(grads_and_vars)
        finally:
            self.in_apply.pop()
        op = op.op if isinstance(op, tf.Tensor) else op
        created = {o.name for o in graph.get_operations()[before:]}
        counter = optimizer.iterations if is_legacy_keras_optimizer(optimizer) else None
        self.applies.append(Apply(optimizer, list(grads_and_vars), global_step, op, created, counter))
        return op


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _check_optimizer(optimizer) -> None:
    if isinstance(optimizer, tf.compat.v1.train.Optimizer) or is_legacy_keras_optimizer(optimizer):
        return
    module, name = type(optimizer).__module__, type(optimizer).__name__
    v1_name = {"SGD": "GradientDescent", "Adagrad": "Adagrad", "Adam": "Adam", "Ftrl": "Ftrl",
               "RMSprop": "RMSProp", "Adadelta": "Adadelta"}.get(name)
    fix = (f"use tf_keras.optimizers.legacy.{name} or tf.compat.v1.train.{v1_name}Optimizer" if v1_name else
           "use a tf.compat.v1.train optimizer (GradientDescent, Momentum, Adagrad, Adam, Ftrl, RMSProp, ...)")
    if module.startswith(("tf_keras", "keras")):
        raise ModelError(f"optimizer is {describe_optimizer(optimizer)}: the new Keras optimizers train nothing in a "
                         f"tf.compat.v1 graph (no variable moves, even on one device); {fix}")
    raise ModelError(f"optimizer is a {describe_optimizer(optimizer)}; parallax_tf needs a tf.compat.v1.train "
                     f"optimizer or a tf_keras.optimizers.legacy one: {fix}")


def call_model_fn(model_fn: Callable, ctx: RunContext) -> Model:
    """Calls model_fn() or model_fn(ctx) and checks what it returned."""
    try:
        takes_ctx = len(inspect.signature(model_fn).parameters) >= 1
    except (TypeError, ValueError):
        takes_ctx = False
    model = model_fn(ctx) if takes_ctx else model_fn()
    if not isinstance(model, Model):
        raise ModelError(f"model_fn returned {type(model).__name__}; {OPTIMIZER_FORM_HELP}")
    if model.loss is None:
        raise ModelError("model_fn returned no loss: pass Model(loss=<scalar tensor>, ...)")
    if model.optimizer is None and model.train_op is None:
        raise ModelError("model_fn returned no optimizer and no train_op: pass Model(..., optimizer="
                         "tf.compat.v1.train.GradientDescentOptimizer(0.1)) or Model(..., train_op=<your train op>)")
    if model.optimizer is not None and model.train_op is not None:
        raise ModelError("model_fn returned both an optimizer and a train_op; pass one: the train_op already "
                         "says how the optimizer is applied")
    if model.optimizer is not None:
        _check_optimizer(model.optimizer)
    if not isinstance(model.loss, tf.Tensor):
        raise ModelError(f"loss is a {type(model.loss).__name__}, not a tensor of the graph model_fn built")
    if model.loss.shape.rank != 0:
        raise ModelError(f"loss {model.loss.name} has shape {model.loss.shape}; it must be a scalar "
                         "(reduce it, e.g. tf.reduce_mean over the batch)")
    check_metrics(model.metrics)
    check_predictions(model.predictions)
    return model


def build(model_fn: Callable, ctx: RunContext, variable_hook=None, shard: bool = True,
          input_decisions: Optional[List[input_shard.InputDecision]] = None) -> Training:
    """Calls model_fn in the default graph, recording how it trains; for the optimizer form,
    adds `optimizer.minimize(loss)` (advancing the model's global step if it has one, after its
    state updates: UPDATE_OPS and tf_keras layer updates).

    `variable_hook(next_creator, kwargs, in_apply)` creates each variable (the rewriter places
    them with it); `in_apply` is true inside an optimizer's apply_gradients (slots). `shard`
    (--shard_input) and `input_decisions` (the plan's): how the tf.data pipelines model_fn builds
    are read by ctx's ranks (parallax_tf.input_shard; without decisions, the Scope decides)."""
    recorder = _Recorder(variable_hook)
    with recorder.recording(), input_shard.sharding(ctx, shard, input_decisions) as inputs:
        model = call_model_fn(model_fn, inputs.ctx)
        train_op = model.train_op
        if not tf.compat.v1.trainable_variables():
            raise ModelError("model_fn created no trainable variables: there is nothing to train")
        if train_op is None:
            updates = list(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS))
            fed = set(needed_placeholders(model.loss))
            for layer in recorder.keras_layer_objects:
                # only the updates of the calls on what the loss reads: a tf_keras model built on
                # its own keras.Input holds updates of that call too, which nothing feeds
                updates += [u for u in _layer_updates(layer) if u not in updates
                            and set(needed_placeholders(u)) <= fed]
            with tf.control_dependencies(updates):
                train_op = _minimize(model.optimizer, model.loss)
        if model.init_op is not None:
            tf.compat.v1.add_to_collection(MODEL_INIT_OPS, _as_operation(model.init_op))
    train_op = _as_operation(train_op)
    needed = ancestors(train_op)
    inputs.warn_unsharded(needed)
    applies = [a for a in recorder.applies if a.op in needed]
    if not applies:
        for optimizer in recorder.new_keras_optimizers:
            _check_optimizer(optimizer)      # the message for a new Keras optimizer, naming its legacy class
        raise ModelError(f"train_op {train_op.name!r} runs no optimizer apply: build it with opt.minimize(loss) or "
                         "opt.apply_gradients(...) of a tf.compat.v1.train or tf_keras.optimizers.legacy optimizer")
    owners: Dict[str, Apply] = {}
    for a in applies:
        for grad, var in a.grads_and_vars:
            if grad is None:
                continue
            if var.op.name in owners and owners[var.op.name] is not a:
                raise ModelError(f"variable {var.op.name!r} is updated by two optimizer applies "
                                 f"({type(owners[var.op.name].optimizer).__name__} {owners[var.op.name].op.name!r} and "
                                 f"{type(a.optimizer).__name__} {a.op.name!r}); give each variable one optimizer")
            owners[var.op.name] = a
    steps = [a.global_step for a in applies if a.global_step is not None]
    if len(steps) > 1:
        raise ModelError(f"the train op advances the global step {len(steps)} times per step (applies "
                         f"{[a.op.name for a in applies if a.global_step is not None]}); pass global_step to one "
                         "apply_gradients/minimize only")
    # without one, the first tf_keras optimizer's `iterations` counts the steps
    steps = steps or [a.own_counter for a in applies if a.own_counter is not None]
    training = Training(model=model, loss=model.loss, train_op=train_op, applies=applies,
                        gradient_calls=recorder.gradient_calls, global_step=steps[0] if steps else None,
                        keras_layers=recorder.keras_layers, inputs=inputs)
    _check_gradients_are_recorded(training)
    return training


def _minimize(optimizer, loss):
    """optimizer.minimize(loss) as single-device TF1 code runs it: a tf.compat.v1.train optimizer
    advances the model's global step (if it has one); a tf_keras one its own `iterations`."""
    if not is_legacy_keras_optimizer(optimizer):
        return optimizer.minimize(loss, global_step=tf.compat.v1.train.get_global_step())
    variables = tf.compat.v1.trainable_variables()
    grads = tf.gradients(loss, variables)
    pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
    return optimizer.apply_gradients(pairs)


def _layer_updates(layer) -> list:
    try:
        updates = layer.updates
    except Exception:   # a layer that was never called has no updates to give
        return []
    return [u.op if isinstance(u, tf.Tensor) else u for u in updates if isinstance(u, (tf.Tensor, tf.Operation))]


def _check_gradients_are_recorded(training: Training) -> None:
    """Every applied gradient derives from a recorded gradient call; the message names the
    variable and the gradient as the user passed them to apply_gradients."""
    raw = training.raw_gradients()
    for name, (grad, var, a) in training.applied().items():
        if name not in raw:
            if isinstance(grad, tf.Variable):
                given = f"the variable {grad.op.name!r}"
            elif isinstance(grad, tf.IndexedSlices):
                given = f"IndexedSlices of {grad.values.name!r}"
            else:
                given = f"tensor {grad.name!r}" if isinstance(grad, tf.Tensor) else repr(grad)
            raise ModelError(f"variable {name!r} is updated by {describe_optimizer(a.optimizer)}.apply_gradients "
                             f"from {given}, which does not come from tf.gradients or optimizer.compute_gradients "
                             "of a loss; parallax_tf must know the raw gradient to average it across ranks. Compute "
                             "it with opt.compute_gradients(loss) or tf.gradients(loss, variables) (a transform "
                             "such as clipping may follow)")


def _as_operation(op) -> tf.Operation:
    if isinstance(op, tf.Operation):
        return op
    if isinstance(getattr(op, "op", None), tf.Operation):   # a tensor, or what assign ops return
        return op.op
    if isinstance(op, (list, tuple)):
        return tf.group(*op)
    raise ModelError(f"train_op is a {type(op).__name__}; pass the tf.Operation your training step runs")
