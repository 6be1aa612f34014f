"""A TF2 step's variables made anew in a graph the pipeline builds (graph.Converter.build):
placed by the rewriter's variable hook as a model_fn's are, split into the plan's row shards
where it says so (split.py)."""
from __future__ import annotations

from typing import Dict, List

import numpy as np
import tensorflow as tf

from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.model import RunContext
from parallax_tf.tf2 import split
from parallax_tf.tf2.naming import VariableNames


def make(captured, slot_owner: Dict[int, tf.Variable], names: VariableNames, values: Dict[int, np.ndarray],
         variable_hook, ctx: RunContext, row_splits: Dict[str, List[int]]) -> Dict[int, object]:
    """id(captured variable) -> it made anew: through `variable_hook` (next_creator, kwargs,
    in_apply), from its starting value in `values` (a trainable one of a rank's graph as zeros:
    rank 0 loads the starting values over them, so no graph holds a copy); a slot (of
    `slot_owner`) next to its variable, and of a variable the hook made this rank's rows of, the
    same rows (r, r+N, ...); a variable in `row_splits`, and its slots, as a split.Shards."""
    made: Dict[int, object] = {}
    for variable in sorted(captured, key=lambda v: id(v) in slot_owner):      # slots last
        owner = slot_owner.get(id(variable))
        name, value = names.of(variable, owner), values[id(variable)]
        if isinstance(made.get(id(owner)), split.Shards):
            made[id(variable)] = _slot_shards(variable, name, value, made[id(owner)], names.of(owner), variable_hook)
        elif name in row_splits and owner is None:
            made[id(variable)] = _shards(variable, name, row_splits[name], variable_hook)
        else:
            if owner is not None and made[id(owner)].shape[0] != owner.shape[0]:
                value = value[ctx.rank::ctx.size]
            zeros = variable_hook is not None and variable.trainable
            start = _zeros(value.shape, variable.dtype) if zeros else _starting_value(value)
            made[id(variable)] = _make(variable, name, start, variable_hook,
                                       made[id(owner)] if owner is not None else None)
    return made


def _shards(variable, name: str, rows: List[int], variable_hook) -> split.Shards:
    shape = variable.shape.as_list()
    parts = [_make(variable, f"{name}/part_{k}", _zeros([count] + shape[1:], variable.dtype), variable_hook, None)
             for k, count in enumerate(rows)]
    _record_slices(parts, name, shape)
    return split.Shards(parts, _stand_in(name))


def _slot_shards(slot, name: str, value: np.ndarray, owner: split.Shards, owner_name: str,
                 variable_hook) -> split.Shards:
    """A slot of a split variable, split as it is (each shard next to its variable's)."""
    short = name[len(owner_name) + 1:] if name.startswith(owner_name + "/") else name.rsplit("/", 1)[-1]
    count = len(owner.parts)
    parts = [_make(slot, f"{part.op.name}/{short}", _starting_value(value[k::count]), variable_hook, part)
             for k, part in enumerate(owner.parts)]
    _record_slices(parts, name, value.shape)
    stand_in = _stand_in(name)
    owner.slot_parts[stand_in.name] = parts
    return split.Shards(parts, stand_in)


def _make(variable, name: str, start, variable_hook, next_to) -> tf.Variable:
    """`variable` made anew as `name` (through the hook; a slot next to its variable `next_to`)."""
    kwargs = dict(initial_value=start, trainable=variable.trainable, name=name,
                  dtype=variable.dtype, use_resource=True, aggregation=variable.aggregation)

    def creator(next_creator, **given):
        if variable_hook is None:
            return next_creator(**given)
        return variable_hook(next_creator, given, in_apply=next_to is not None)
    with tf.variable_creator_scope(creator):
        if next_to is None:
            return tf.Variable(**kwargs)
        with tf.compat.v1.colocate_with(next_to.op):
            return tf.Variable(**kwargs)


def pieces(made) -> list:
    """A made variable's tf.Variables: itself, or a split one's shards."""
    return made.parts if isinstance(made, split.Shards) else [made]


def handle(made) -> tf.Tensor:
    """What the imported step reads for a variable: its handle, or a split one's stand-in."""
    return made.stand_in if isinstance(made, split.Shards) else made.handle


def _record_slices(parts: list, name: str, shape) -> None:
    """The shards as parts of the whole variable `name` (their single-device name), in order."""
    start = 0
    for part in parts:
        tf_shim.set_save_slice_info(part, name, shape, [start] + [0] * (len(shape) - 1), part.shape.as_list())
        start += int(part.shape[0])


def _stand_in(name: str) -> tf.Tensor:
    """A resource placeholder the imported step's uses of a split variable read until the split
    replaces them (never fed: a use left over fails loudly)."""
    return tf.compat.v1.placeholder(tf.resource, [], name=f"{name.replace('/', '_')}_whole")


def _starting_value(value: np.ndarray):
    """A variable's starting value in a graph: one of a single number (zeros, an accumulator's
    start) as a fill; any other as a constant, which every graph built holds a copy of."""
    flat = value.reshape(-1)
    if flat.size > 1 and value.dtype.kind in "biuf" and (flat == flat[0]).all():
        return lambda: tf.fill(value.shape, tf.constant(flat[0], dtype=value.dtype))
    return value


def _zeros(shape, dtype):
    return lambda: tf.zeros(shape, dtype.base_dtype)
