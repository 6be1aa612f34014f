"""An optimizer's hyper-parameters that a TF2 step only reads, read as constants by rank 0.

A legacy tf_keras optimizer (and a Keras 3 one) keeps its learning rate, beta, l2, ... in
variables the step reads. Imported as they are, every parameter server's apply in rank 0's step
asks rank 0's worker for each one every step, in a RecvTensor call of its own. Rank 0's build
reads them as the values its variables hold when the run starts instead, and
runtime/placement.py makes such small constants again on every task that reads them. The other
ranks read their variables, which start as rank 0's (every rank's copy of a replicated variable
is rank 0's after the start's broadcast), so every rank applies rank 0's value, as before, also
when a callback that runs on rank 0 only (ptf.fit's) set it. The variables themselves stay, so
checkpoints and results hold them; a script that changes one between runs gets the new value in
the next run, which reads it when it starts."""
from __future__ import annotations

from typing import Dict, List

import tensorflow as tf

from parallax_tf import graph_walk


def fixed_reads(graph, variables: Dict[str, tf.Variable], hyper: set) -> Dict[str, tf.Variable]:
    """The reads of each scalar, non-trainable variable in `hyper` (ids of the variables the
    step's optimizers hold) that `graph` (the trace's) only reads: read tensor name -> the
    variable. A variable any op of the step writes, or passes to anything but a read (its
    counter), is not fixed."""
    reads: Dict[str, tf.Variable] = {}
    for op_name, variable in variables.items():
        if id(variable) not in hyper or variable.trainable or variable.shape.rank != 0:
            continue
        uses = _handle_uses(graph.get_operation_by_name(op_name).outputs[0])
        if uses and all(use.type == "ReadVariableOp" for use in uses):
            reads.update({use.outputs[0].name: variable for use in uses})
    return reads


def _handle_uses(handle: tf.Tensor) -> List[tf.Operation]:
    """The ops using a variable's handle, past the ops that only pass it on."""
    uses, frontier = [], [handle]
    while frontier:
        for consumer in frontier.pop().consumers():
            if consumer.type in graph_walk.HANDLE_PASS_THROUGH_OPS:
                frontier.extend(consumer.outputs)
            else:
                uses.append(consumer)
    return uses
