"""A dynamic table's optimizer, row by row: the update rule of the model's tf.compat.v1.train
optimizer applied to the rows a step touched, with the optimizer's slots kept per row beside
them. A rule is data (its kind, hyper-parameters and slots) that a table's backend reads;
`apply` is its standard-op form. The formulas are TF's sparse kernels' (training_ops.cc); Adam
is lazy: only touched rows move, with bias correction by the table's own step count."""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Tuple

import numpy as np
import tensorflow as tf

from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.compat import tf_keras as tf_keras_shim
from parallax_tf.errors import ModelError

SUPPORTED = ("GradientDescentOptimizer", "MomentumOptimizer", "AdagradOptimizer", "AdamOptimizer", "FtrlOptimizer")


@dataclasses.dataclass
class RowRule:
    """`kind` (sgd, momentum, adagrad, adam, ftrl); `hyper`: its hyper-parameters by name, each a
    number, a tensor or a callable returning one (as the optimizer holds them); `slots`: each
    slot's name and the value a new row's slot starts at."""
    kind: str
    hyper: Dict[str, object]
    slots: List[Tuple[str, float]]

    def value(self, name: str, dtype) -> tf.Tensor:
        """Hyper-parameter `name` as a tensor of `dtype` (a callable one called now)."""
        value = self.hyper[name]
        return tf.cast(value() if callable(value) else value, dtype)

    def apply(self, rows, slots: Dict[str, tf.Tensor], grads, step) -> tuple:
        """(rows, slots) after the rule's step on [n, dim] `rows`, `slots` and `grads`; `step`:
        int64 boundaries the table saw before."""
        return _APPLY[self.kind](self, rows, slots, grads, step)


def rule_for(optimizer) -> RowRule:
    """The row rule of a tf.compat.v1.train optimizer or a Keras one (Keras 3, tf_keras), or one
    ModelError naming those that have one."""
    in_graph = getattr(optimizer, "in_graph", None)     # a traced step's optimizer, with its variables here
    if in_graph is not None:
        optimizer = optimizer.used
    kind = type(optimizer).__name__
    if _is_keras(optimizer):
        return _keras_rule(optimizer, in_graph or (lambda value: None))
    train = tf.compat.v1.train
    if isinstance(optimizer, train.MomentumOptimizer):
        lr, momentum, nesterov = tf_shim.momentum_hyper_parameters(optimizer)
        return RowRule("momentum", dict(learning_rate=lr, momentum=momentum, nesterov=bool(nesterov)),
                       [("momentum", 0.0)])
    if isinstance(optimizer, train.AdagradOptimizer):
        lr, initial = tf_shim.adagrad_hyper_parameters(optimizer)
        return RowRule("adagrad", dict(learning_rate=lr), [("accumulator", float(initial))])
    if isinstance(optimizer, train.AdamOptimizer):
        lr, beta1, beta2, epsilon = tf_shim.adam_hyper_parameters(optimizer)
        return RowRule("adam", dict(learning_rate=lr, beta1=beta1, beta2=beta2, epsilon=epsilon),
                       [("m", 0.0), ("v", 0.0)])
    if isinstance(optimizer, train.FtrlOptimizer):
        hyper = tf_shim.ftrl_hyper_parameters(optimizer)
        return RowRule("ftrl", dict(learning_rate=hyper["learning_rate"],
                                    learning_rate_power=float(hyper["learning_rate_power"]),
                                    l1=hyper["l1_regularization_strength"], l2=hyper["l2_regularization_strength"],
                                    beta=hyper["beta"] or 0.0,
                                    l2_shrinkage=hyper["l2_shrinkage_regularization_strength"]),
                       [("accum", float(hyper["initial_accumulator_value"])), ("linear", 0.0)])
    if isinstance(optimizer, train.GradientDescentOptimizer):
        return RowRule("sgd", dict(learning_rate=tf_shim.learning_rate(optimizer)), [])
    raise ModelError(f"a dynamic embedding table cannot train with {kind}: its rows train with one of "
                     f"tf.compat.v1.train's {', '.join(SUPPORTED)} (pass one as Model(optimizer=...) or "
                     "DynamicEmbedding(..., optimizer=...))")


KERAS_SUPPORTED = ("SGD", "Adagrad", "Adam", "Ftrl")


def _is_keras(optimizer) -> bool:
    module = type(optimizer).__module__
    return module.split(".")[0] in ("keras", "tf_keras")


def _keras_rule(optimizer, in_graph: Callable) -> RowRule:
    """A Keras optimizer's rule, in the form of its tf.compat.v1.train twin: SGD (momentum and
    Nesterov as TF1's accumulator, the same steps), Adagrad (without Keras' epsilon under the
    square root), lazy Adam, Ftrl. A hyper-parameter held in a variable reads the graph's copy
    (`in_graph`: the graph's variable for the optimizer's own, or None), else its value now."""
    def value(v):
        return _keras_value(v, in_graph)

    kind = type(optimizer).__name__
    if kind not in KERAS_SUPPORTED or getattr(optimizer, "amsgrad", False):
        raise ModelError(f"a dynamic embedding table cannot train with Keras' {kind}"
                         f"{' (amsgrad)' if getattr(optimizer, 'amsgrad', False) else ''}: its rows train with "
                         f"{', '.join(KERAS_SUPPORTED)} (pass one to compile, or DynamicEmbedding(..., optimizer=...))")
    settings = tf_keras_shim.legacy_optimizer_settings(optimizer)     # {} for Keras 3's

    def setting(name: str):
        return settings[name] if name in settings else getattr(optimizer, name)
    if float(settings.get("decay", 0.0)):
        raise ModelError(f"a dynamic embedding table trains with a constant learning rate; {kind} has decay="
                         f"{settings['decay']} (give the table DynamicEmbedding(..., optimizer=...) of its own)")
    lr = value(_constant_rate(optimizer, kind))
    if kind == "SGD":
        momentum = value(optimizer.momentum)
        if settings.get("momentum") is False or isinstance(momentum, float) and momentum == 0.0:
            return RowRule("sgd", dict(learning_rate=lr), [])
        return RowRule("momentum", dict(learning_rate=lr, momentum=momentum,
                                        nesterov=bool(getattr(optimizer, "nesterov", False))), [("momentum", 0.0)])
    if kind == "Adagrad":
        return RowRule("adagrad", dict(learning_rate=lr),
                       [("accumulator", float(setting("initial_accumulator_value")))])
    if kind == "Adam":
        return RowRule("adam", dict(learning_rate=lr, beta1=value(optimizer.beta_1), beta2=value(optimizer.beta_2),
                                    epsilon=float(optimizer.epsilon)), [("m", 0.0), ("v", 0.0)])
    power = value(optimizer.learning_rate_power)
    if not isinstance(power, float):
        raise ModelError(f"a dynamic embedding table reads {kind}'s learning_rate_power when the step is built, and "
                         "this one holds it in a graph variable: give the table DynamicEmbedding(..., optimizer="
                         "tf.compat.v1.train.FtrlOptimizer(...)) of its own")
    return RowRule("ftrl", dict(learning_rate=lr, learning_rate_power=power,
                                l1=value(optimizer.l1_regularization_strength),
                                l2=value(optimizer.l2_regularization_strength), beta=value(optimizer.beta),
                                l2_shrinkage=float(setting("l2_shrinkage_regularization_strength"))),
                   [("accum", float(setting("initial_accumulator_value"))), ("linear", 0.0)])


def _constant_rate(optimizer, kind: str):
    """The optimizer's learning rate: a number or the variable holding it; a schedule is refused
    (Keras 3 computes it from the step count, a legacy tf_keras optimizer holds the schedule)."""
    try:
        rate = optimizer.learning_rate
    except (TypeError, ValueError, RuntimeError):
        rate = None
    inner = getattr(rate, "value", None)
    if isinstance(rate, (int, float, tf.Variable)) or isinstance(inner, tf.Variable):
        return rate
    raise ModelError(f"a dynamic embedding table trains with a constant learning rate, and {kind}'s follows a "
                     "schedule: give the table DynamicEmbedding(..., optimizer=...) of its own")


def _keras_value(value, in_graph: Callable):
    """A hyper-parameter: a number, the graph's copy of the variable holding it, or the value of
    an eager one now; a tensor of the graph being built stays a tensor."""
    if isinstance(value, (int, float)):
        return float(value)
    here = in_graph(value)
    if here is not None:
        return here
    inner = getattr(value, "value", None)          # a Keras 3 variable's tf.Variable
    value = inner if isinstance(inner, tf.Variable) and not isinstance(value, tf.Variable) else value
    try:
        graph = value.graph
    except (AttributeError, RuntimeError):        # an eager tensor or variable has none
        graph = None
    if graph is tf.compat.v1.get_default_graph():
        return value
    with tf.init_scope():
        return float(np.asarray(value))


def _sgd_step(rule, rows, slots, grads, step):
    return rows - rule.value("learning_rate", rows.dtype) * grads, {}


def _momentum_step(rule, rows, slots, grads, step):
    lr_t, mom = rule.value("learning_rate", rows.dtype), rule.value("momentum", rows.dtype)
    accum = slots["momentum"] * mom + grads
    step_size = grads * lr_t + accum * mom * lr_t if rule.hyper["nesterov"] else accum * lr_t
    return rows - step_size, {"momentum": accum}


def _adagrad_step(rule, rows, slots, grads, step):
    accum = slots["accumulator"] + grads * grads
    return rows - rule.value("learning_rate", rows.dtype) * grads * tf.math.rsqrt(accum), {"accumulator": accum}


def _adam_step(rule, rows, slots, grads, step):
    dtype = rows.dtype
    b1, b2, eps = (rule.value(name, dtype) for name in ("beta1", "beta2", "epsilon"))
    t = tf.cast(step + 1, tf.float64)
    b1_power = tf.cast(tf.pow(tf.cast(b1, tf.float64), t), dtype)
    b2_power = tf.cast(tf.pow(tf.cast(b2, tf.float64), t), dtype)
    lr_t = rule.value("learning_rate", dtype) * tf.sqrt(1 - b2_power) / (1 - b1_power)
    m = slots["m"] * b1 + grads * (1 - b1)
    v = slots["v"] * b2 + grads * grads * (1 - b2)
    return rows - lr_t * m / (tf.sqrt(v) + eps), {"m": m, "v": v}


def _ftrl_step(rule, rows, slots, grads, step):
    dtype = rows.dtype
    lr = rule.value("learning_rate", dtype)
    power = rule.hyper["learning_rate_power"]
    l1 = rule.value("l1", dtype)
    l2 = rule.value("l2", dtype) + rule.value("beta", dtype) / (2.0 * lr)
    shrinkage = rule.value("l2_shrinkage", dtype)
    accum, linear = slots["accum"], slots["linear"]
    new_accum = accum + grads * grads
    shrunk = grads + 2.0 * shrinkage * rows
    if power == -0.5:
        linear = linear + shrunk - (tf.sqrt(new_accum) - tf.sqrt(accum)) / lr * rows
        quadratic = tf.sqrt(new_accum) / lr + 2.0 * l2
    else:
        linear = linear + shrunk - (tf.pow(new_accum, -power) - tf.pow(accum, -power)) / lr * rows
        quadratic = tf.pow(new_accum, -power) / lr + 2.0 * l2
    shrunk_linear = l1 * tf.sign(linear) - linear
    rows = tf.where(tf.abs(linear) > l1, shrunk_linear / quadratic, tf.zeros_like(rows))
    return rows, {"accum": new_accum, "linear": linear}


_APPLY: Dict[str, Callable] = dict(sgd=_sgd_step, momentum=_momentum_step, adagrad=_adagrad_step, adam=_adam_step,
                                  ftrl=_ftrl_step)
