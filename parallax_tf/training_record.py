"""The training record: what any front end found of how a model trains, as the later stages
read it (front-end-neutral data: a model_fn's build and a traced TF2 step both produce it).

The loss, the train op, each gradient computation (the raw gradients, of which loss), each
apply (which optimizer updates which variable from which gradient, and the ops it made), the
global step, and the tf.data pipelines the front end made."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import tensorflow as tf

from parallax_tf.graph_walk import VARIABLE_OPS
from parallax_tf.input_shard import Scope
from parallax_tf.model import Model


@dataclasses.dataclass
class GradientCall:
    """One gradient computation (tf.gradients, compute_gradients, a GradientTape): grads[i] = d(sum
    ys * grad_ys)/d xs[i]."""
    ys: list
    grad_ys: object
    xs: list
    grads: list


@dataclasses.dataclass
class Apply:
    """One optimizer apply (or a hand-written update): what updates which variables."""
    optimizer: object               # None: a hand-written update
    grads_and_vars: list            # (transformed gradient, variable), as the user passed them
    global_step: object             # the variable it advances, or None
    op: tf.Operation                # what apply_gradients returned
    created: set                    # names of the ops it created (updates, slots, non-slot state)
    own_counter: object = None      # a tf_keras optimizer's `iterations`, which its apply advances


@dataclasses.dataclass
class Training:
    model: Model
    loss: tf.Tensor
    train_op: tf.Operation          # the user's, or minimize() for the optimizer form
    applies: List[Apply]            # those the train op runs
    gradient_calls: List[GradientCall]
    global_step: object             # the variable the train op advances once per step, or None
    keras_layers: Dict[str, str]    # variable op name -> the tf_keras layer class that made it
    inputs: Scope                   # the tf.data pipelines the model made, and whether each is sharded
    # variable op names whose apply is not a sum over a sparse gradient's rows (a TF2 optimizer
    # that squares each row): repeated ids must reach it row by row, not summed first
    rows_each: set = dataclasses.field(default_factory=set)
    # a front end that splits variables into row shards itself (a traced step): variable op name
    # -> why it cannot split that one. None: get_variable's partitioner splits them (a model_fn).
    split_refusals: Optional[Dict[str, str]] = None
    # what dynamic tables' rows are differentiated from: (ys, grad_ys) of each gradient call of a
    # traced step, whose returned loss may be a running mean; None: the loss
    row_targets: Optional[List[tuple]] = None

    def raw_gradients(self) -> Dict[str, tuple]:
        """Applied variable (op name) -> (its raw gradient, the gradient call it came from)."""
        found = {}
        for call in self.gradient_calls:
            for x, grad in zip(call.xs, call.grads):
                if grad is None:
                    continue
                if isinstance(x, tf.Variable):
                    found[x.op.name] = (grad, call)
                elif isinstance(x, tf.Tensor) and x.op.type in VARIABLE_OPS:
                    found[x.op.name] = (grad, call)    # a ref variable's ref (compute_gradients)
        return found

    def applied(self) -> Dict[str, tuple]:
        """Applied variable (op name) -> (transformed gradient, variable, Apply)."""
        return {v.op.name: (g, v, a) for a in self.applies for g, v in a.grads_and_vars if g is not None}

    def created_by_optimizers(self) -> set:
        return set().union(*(a.created for a in self.applies)) if self.applies else set()


def storage(variable) -> tf.Tensor:
    """The tensor ops use to reach a variable: its resource handle, or a ref variable's ref."""
    handle = getattr(variable, "handle", None)
    return handle if handle is not None and handle.dtype == tf.resource else variable.op.outputs[0]
