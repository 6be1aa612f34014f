"""Running a train op without some of its ops: those another rank runs (rank 0's writes of PS
variables in the synchronous strategies; in Stanza the head's updates on conv nodes and the
feature extractor's on FC nodes)."""
from __future__ import annotations

from typing import Dict

import tensorflow as tf

from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.errors import ModelError
from parallax_tf.graph_walk import (HANDLE_PASS_THROUGH_OPS, RESOURCE_VARIABLE_OPS, WRITE_OPS, ancestors, feeding_op,
                                    reachable)

_APPLY_PREFIXES = ("ResourceApply", "ResourceSparseApply", "Apply", "SparseApply")
# Inputs of a dropped op that are themselves nothing to wait for (a constant, a variable's
# handle), only their own control inputs are: across tasks every control edge is a message.
_STATELESS_SOURCES = frozenset({"Const"}) | RESOURCE_VARIABLE_OPS


def needed_without(target, dropped: set, gradient_ops: set, through_inputs: bool = True) -> set:
    """What this rank runs: `target`'s ancestors, passing through a dropped op only by what it
    waits for (control inputs, and, `through_inputs`, inputs that carry no gradient)."""
    def inputs(op):
        return [t.op for t in op.inputs if op not in dropped or (through_inputs and t.op not in gradient_ops)] \
            + list(op.control_inputs)
    return reachable([target], inputs)


def without(target, dropped: set, gradient_ops: set, token: tf.Operation, through_inputs: bool = True) -> tf.Operation:
    """`target` without the dropped ops: whatever waited for one of them waits for `token`
    instead, and for what that op itself waited for (e.g. the AllReduce applies behind an
    increment of the global step): its control inputs and, `through_inputs`, the inputs
    that carry no gradient. Stanza passes False: a dropped op is the other side's work, and
    what it computes from (the other side's forward) must not run here."""
    memo: Dict[tf.Operation, set] = {}

    def waited_for(op) -> set:
        if op not in memo:
            memo[op] = set()
            # TF hangs a control dependency on a new op's inputs when they already carry it
            inputs = [t.op for t in op.inputs if t.op not in gradient_ops] if through_inputs else []
            for before in list(op.control_inputs) + inputs:
                memo[op] |= wait_on(before)
        return memo[op]

    def wait_on(op) -> set:
        if op in dropped:
            return waited_for(op)
        if op.type in _STATELESS_SOURCES:     # only what it was made to wait for, if anything
            return set().union(*(wait_on(c) for c in op.control_inputs))
        return {op}

    for op in needed_without(target, dropped, gradient_ops, through_inputs) - dropped:
        if any(c in dropped for c in op.control_inputs):
            keep = [c for c in op.control_inputs if c not in dropped]
            extra = set().union(*(waited_for(c) for c in op.control_inputs if c in dropped)) - set(keep)
            tf_shim.remove_all_control_inputs(op)
            tf_shim.add_control_inputs(op, keep + sorted(extra, key=lambda o: o.name) + [token])
            if op.type == "NoOp":   # e.g. an optimizer's group of applies on a server: wait by the token
                tf_shim.set_device(op, token.device)
        used = [t for t in op.inputs if t.op in dropped]
        if used:
            raise ModelError(f"op {op.name!r} uses the output of {used[0].op.name!r}, which updates a variable "
                             "another rank updates (this rank does not run it); make it depend on the update by "
                             "control only")
    if target not in dropped:
        return target
    return tf.group(token, *sorted(waited_for(target), key=lambda o: o.name))


def update_without(training, target, theirs: set, global_grads: dict, token_name: str, check=None) -> tf.Operation:
    """The model's own train op `target` updating only this rank's variables: its transform and
    applies read `global_grads` (variable op name -> gradient) and every op writing one of
    `theirs` (variable and slot op names another rank updates) is dropped, together with the
    other side's work it computes from. `check(transform, needed)`, if given, sees the transform
    and what the step still runs before anything is rewired."""
    from rewriters.shared import transform as transform_lib
    needed = ancestors(target)
    transform = transform_lib.analyse(training, needed)
    gradient_ops = set(transform.depends)
    dropped = {op for op in needed if writes(op, theirs)}
    if check is not None:
        check(transform, needed_without(target, dropped, gradient_ops, through_inputs=False) - dropped)
    transform_lib.feed_global_gradients(transform, global_grads, needed)
    return without(target, dropped, gradient_ops, tf.no_op(name=token_name), through_inputs=False)


def variable_and_slot_ops(training, parts: dict, names: set) -> set:
    """Op names of the named variables' pieces (`parts`: name -> pieces) and of their
    optimizer slots."""
    found = set()
    for name in names:
        for part in parts[name]:
            found.add(part.variable.op.name)
            for apply in training.applies:
                for slot in apply.optimizer.get_slot_names():
                    var = apply.optimizer.get_slot(part.variable, slot)
                    if var is not None:
                        found.add(var.op.name)
    return found


def written_variables(op) -> list:
    """The variable ops an assign or optimizer apply changes (looking back through what passes a
    handle on); [] for any other op."""
    if op.type not in WRITE_OPS and not op.type.startswith(_APPLY_PREFIXES):
        return []
    found = []
    for tensor in op.inputs:
        if tensor.dtype == tf.resource or tf_shim.is_ref_dtype(tensor.dtype):
            found.append(feeding_op(tensor, HANDLE_PASS_THROUGH_OPS))
    return found


def writes(op, names: set) -> bool:
    """Whether the op changes one of the named variables (by op name)."""
    return any(source.name in names for source in written_variables(op))
