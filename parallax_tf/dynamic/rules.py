"""A dynamic table's optimizer, row by row: the update rule of the model's tf.compat.v1.train
optimizer applied to the rows a step touched, with the optimizer's slots kept per row beside
them. The formulas are TF's sparse kernels' (training_ops.cc); Adam is lazy: only touched rows
move, with bias correction by the table's own step count."""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Tuple

import tensorflow as tf

from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.errors import ModelError

SUPPORTED = ("GradientDescentOptimizer", "MomentumOptimizer", "AdagradOptimizer", "AdamOptimizer", "FtrlOptimizer")


@dataclasses.dataclass
class RowRule:
    """`apply(rows, slots, grads, step) -> (rows, slots)` on [n, dim] tensors; `slots`: each slot's
    name and the value a new row's slot starts at; `step`: int64 boundaries the table saw before."""
    optimizer: str
    slots: List[Tuple[str, float]]
    apply: Callable[[tf.Tensor, Dict[str, tf.Tensor], tf.Tensor, tf.Tensor], tuple]


def rule_for(optimizer) -> RowRule:
    """The row rule of a tf.compat.v1.train optimizer, or one ModelError naming those that have one."""
    kind = type(optimizer).__name__
    train = tf.compat.v1.train
    if isinstance(optimizer, train.MomentumOptimizer):
        return _momentum_rule(optimizer)
    if isinstance(optimizer, train.AdagradOptimizer):
        return _adagrad_rule(optimizer)
    if isinstance(optimizer, train.AdamOptimizer):
        return _adam_rule(optimizer)
    if isinstance(optimizer, train.FtrlOptimizer):
        return _ftrl_rule(optimizer)
    if isinstance(optimizer, train.GradientDescentOptimizer):
        return _sgd_rule(optimizer)
    raise ModelError(f"a dynamic embedding table cannot train with {kind}: its rows train with one of "
                     f"tf.compat.v1.train's {', '.join(SUPPORTED)} (pass one as Model(optimizer=...) or "
                     "DynamicEmbedding(..., optimizer=...))")


def _value(optimizer, value, dtype):
    return tf.cast(tf_shim.call_if_callable(optimizer, value), dtype)


def _sgd_rule(optimizer) -> RowRule:
    def apply(rows, slots, grads, step):
        return rows - _value(optimizer, tf_shim.learning_rate(optimizer), rows.dtype) * grads, {}
    return RowRule("sgd", [], apply)


def _momentum_rule(optimizer) -> RowRule:
    lr, momentum, nesterov = tf_shim.momentum_hyper_parameters(optimizer)

    def apply(rows, slots, grads, step):
        lr_t, mom = _value(optimizer, lr, rows.dtype), _value(optimizer, momentum, rows.dtype)
        accum = slots["momentum"] * mom + grads
        step_size = grads * lr_t + accum * mom * lr_t if nesterov else accum * lr_t
        return rows - step_size, {"momentum": accum}
    return RowRule("momentum", [("momentum", 0.0)], apply)


def _adagrad_rule(optimizer) -> RowRule:
    lr, initial = tf_shim.adagrad_hyper_parameters(optimizer)

    def apply(rows, slots, grads, step):
        accum = slots["accumulator"] + grads * grads
        return rows - _value(optimizer, lr, rows.dtype) * grads * tf.math.rsqrt(accum), {"accumulator": accum}
    return RowRule("adagrad", [("accumulator", float(initial))], apply)


def _adam_rule(optimizer) -> RowRule:
    lr, beta1, beta2, epsilon = tf_shim.adam_hyper_parameters(optimizer)

    def apply(rows, slots, grads, step):
        dtype = rows.dtype
        b1, b2, eps = (_value(optimizer, v, dtype) for v in (beta1, beta2, epsilon))
        t = tf.cast(step + 1, tf.float64)
        b1_power = tf.cast(tf.pow(tf.cast(b1, tf.float64), t), dtype)
        b2_power = tf.cast(tf.pow(tf.cast(b2, tf.float64), t), dtype)
        lr_t = _value(optimizer, lr, dtype) * tf.sqrt(1 - b2_power) / (1 - b1_power)
        m = slots["m"] * b1 + grads * (1 - b1)
        v = slots["v"] * b2 + grads * grads * (1 - b2)
        return rows - lr_t * m / (tf.sqrt(v) + eps), {"m": m, "v": v}
    return RowRule("adam", [("m", 0.0), ("v", 0.0)], apply)


def _ftrl_rule(optimizer) -> RowRule:
    hyper = tf_shim.ftrl_hyper_parameters(optimizer)

    def apply(rows, slots, grads, step):
        dtype = rows.dtype
        lr = _value(optimizer, hyper["learning_rate"], dtype)
        power = float(hyper["learning_rate_power"])
        l1 = _value(optimizer, hyper["l1_regularization_strength"], dtype)
        l2 = _value(optimizer, hyper["l2_regularization_strength"], dtype) + \
            _value(optimizer, hyper["beta"] or 0.0, dtype) / (2.0 * lr)
        shrinkage = _value(optimizer, hyper["l2_shrinkage_regularization_strength"], dtype)
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
    return RowRule("ftrl", [("accum", float(hyper["initial_accumulator_value"])), ("linear", 0.0)], apply)
