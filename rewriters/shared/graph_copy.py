"""Copies of a piece of the model's graph that read other inputs (Stanza's micro-batches: the
feature extractor once per micro-batch of the input, the head once per micro-batch of the cut).

Only the ops that depend on the replaced tensors are copied; everything else (variable reads,
constants) is shared, so the copies train the same variables."""
from __future__ import annotations

from typing import Dict, List

import tensorflow as tf

from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.graph_walk import ancestors


def copy_between(replace: Dict[str, tf.Tensor], outputs: List[tf.Tensor], suffix: str) -> List[tf.Tensor]:
    """`outputs` recomputed with each tensor named in `replace` (name -> replacement) swapped
    for its replacement. The copies are named after the originals plus `suffix`."""
    needed = set().union(*(ancestors(t.op, data_only=True) for t in outputs))
    mapping = dict(replace)
    graph = outputs[0].graph
    for op in sorted(needed, key=tf_shim.creation_order):   # inputs first
        if not any(t.name in mapping for t in op.inputs) or op.name in mapping:
            continue
        attrs = {k: v for k, v in op.node_def.attr.items() if k != "_class"}
        with tf.compat.v1.name_scope(None), tf.device(op.device):
            copied = graph.create_op(op.type, [mapping.get(t.name, t) for t in op.inputs],
                                     [t.dtype for t in op.outputs], name=op.name + suffix, attrs=attrs,
                                     op_def=op.op_def)
        tf_shim.add_control_inputs(copied, op.control_inputs)
        mapping.update({original.name: new for original, new in zip(op.outputs, copied.outputs)})
    missing = [t.name for t in outputs if t.name not in mapping]
    if missing:
        raise ValueError(f"{missing} do not depend on {sorted(replace)}")
    return [mapping[t.name] for t in outputs]

