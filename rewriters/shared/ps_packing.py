"""One message each way per parameter server and step, however many variables live there.

Every tensor that crosses between tasks is a RecvTensor call of its own (a gRPC round trip, its
headers and segments, runtime CPU at both ends). A rank looking up two tables sharded over every
server made two id messages, two row answers and two pushes per server and step; packed, one of
each: the distinct ids of all its lookups on that server with their counts in front, all their
rows back in one tensor, and all its summed rows in one push. The server splits what it gets by
the counts it was sent; the worker splits what comes back by the counts it computed.

A lookup whose ids depend on another PS lookup's rows keeps its own messages (packing it with
that lookup would wait on itself). The pushes of one server wait for each other's gradients:
on a slow link the bytes are what counts, not their overlap with the backward pass.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List

import tensorflow as tf

from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.graph_walk import ancestors
from rewriters.shared.rebuild import DistinctLookup
from rewriters.shared.step_report import tensor_bytes
from rewriters.shared.transform import rewire


@dataclasses.dataclass(eq=False)
class ServerPack:
    """The lookups one rank packs for one server, in packing order."""
    device: str
    names: List[str]                 # variable op names
    row_shapes: List[list]
    ids_on_server: List[tf.Tensor]   # per lookup, its distinct ids as the server received them
    counts_on_server: tf.Tensor      # int64 [k]: how many ids each lookup sent
    moved: tf.Tensor                 # bytes that crossed for the pull (ids and rows), on the worker

    def push(self, values: Dict[str, tf.Tensor]) -> Dict[str, tf.Tensor]:
        """Summed rows (variable op name -> [ids, *row shape] on the worker, for some of this
        pack's lookups) sent as one tensor; returns them as the server splits them."""
        order = [i for i, name in enumerate(self.names) if name in values]
        flat = tf.concat([tf.reshape(values[self.names[i]], [-1]) for i in order], 0)
        widths = tf.constant([_width(self.row_shapes[i]) for i in order], tf.int64)
        with tf.device(self.device):
            sizes = tf.gather(self.counts_on_server, order) * widths
            pieces = tf.split(flat, sizes, num=len(order))
            return {self.names[i]: tf.reshape(piece, [-1] + self.row_shapes[i]) for i, piece in zip(order, pieces)}


def pack_pulls(lookups: Dict[str, DistinctLookup], variables: Dict[str, tf.Variable]) -> List[ServerPack]:
    """Rewires the forward so that the lookups of `variables` (op name -> variable on a server)
    share one message each way per server (the server in the rank's own process too: a message
    between tasks costs CPU even there). Returns a pack per server with two or more of them."""
    gathers = {lookup.gather for lookup in lookups.values()}
    by_server: Dict[tuple, List[str]] = {}
    for name in sorted(variables):
        lookup = lookups.get(name)
        if lookup is None or ancestors(lookup.ids.op) & gathers:
            continue
        var = variables[name]
        by_server.setdefault((var.device, var.dtype.base_dtype), []).append(name)
    return [_pack(device, names, lookups, variables) for (device, _), names in sorted(by_server.items(),
                                                                                        key=lambda kv: kv[0][0])
            if len(names) > 1]


def _pack(device: str, names: List[str], lookups: Dict[str, DistinctLookup], variables) -> ServerPack:
    ids = [lookups[name].ids for name in names]
    row_shapes = [variables[name].shape[1:].as_list() for name in names]
    counts = tf.stack([tf.size(i, out_type=tf.int64) for i in ids])
    sent = tf.concat([counts] + ids, 0)
    with tf.device(device):
        counts_on_server = sent[:len(names)]
        ids_on_server = tf.split(sent[len(names):], counts_on_server, num=len(names))
        for name, server_ids in zip(names, ids_on_server):
            tf_shim.update_input(lookups[name].gather, 1, server_ids)
        rows = [lookups[name].gather.outputs[0] for name in names]
        flat = [tf.reshape(r, [-1]) for r in rows]
        packed = tf.concat(flat, 0)
    sizes = counts * tf.constant([_width(s) for s in row_shapes], tf.int64)
    for old, piece, shape, own in zip(rows, tf.split(packed, sizes, num=len(names)), row_shapes, flat):
        new = tf.reshape(piece, [-1] + shape)
        new.set_shape(old.shape)
        rewire(old, new, set(old.consumers()) - {own.op})
    return ServerPack(device, names, row_shapes, ids_on_server, counts_on_server,
                      moved=tensor_bytes(sent) + tensor_bytes(packed))


def _width(row_shape: list) -> int:
    return tf.TensorShape(row_shape).num_elements()
