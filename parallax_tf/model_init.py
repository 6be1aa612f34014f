"""What a single-device script initialises besides its variables, and where its input comes from.

A TF1 script runs `tables_initializer()`, the local-init op of a Scaffold and its iterators'
initializers before training. On every rank that runs the model's ops the toolkit runs the same:
- lookup-table initializers (TABLE_INITIALIZERS: vocabulary feature columns, StaticHashTable,
  index_table_from_tensor register there);
- the initializer ops inside LOCAL_INIT_OP and Model.init_op, not their variable writes
  (variables start from their own initializers' single-device values, as everywhere);
- the initializer of every initializable tf.data iterator the step reads from.
Only initializer ops themselves are run (see INITIALIZER_OPS), never a whole group that would
also reset variables a parameter server holds.
"""
from __future__ import annotations

from typing import Iterable, List

import tensorflow as tf

from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.errors import ModelError
from parallax_tf.graph_walk import (FEEDABLE_ITERATOR_OPS, ITERATOR_OPS, ITERATOR_READ_OPS, ancestors,
                                    needed_placeholders)
from parallax_tf.training_graph import MODEL_INIT_OPS

INITIALIZER_OPS = {"InitializeTable", "InitializeTableV2", "InitializeTableFromTextFile",
                   "InitializeTableFromTextFileV2", "InitializeTableFromDataset", "LookupTableImport",
                   "LookupTableImportV2", "MakeIterator"}


def declared(graph) -> List[tf.Operation]:
    """The init ops the model declares: table initializers, the local-init op, Model.init_op."""
    keys = (tf.compat.v1.GraphKeys.TABLE_INITIALIZERS, tf.compat.v1.GraphKeys.LOCAL_INIT_OP, MODEL_INIT_OPS)
    found = []
    for key in keys:
        for item in graph.get_collection(key):
            op = item.op if isinstance(item, tf.Tensor) else item
            if isinstance(op, tf.Operation) and op not in found:
                found.append(op)
    return found


def initializers(graph, step: Iterable) -> List[tf.Operation]:
    """The initializer ops every rank runs before its first step: those the declared init ops
    contain, and the initializer of each initializable iterator `step` (the train targets) reads.
    Raises ModelError for input the toolkit cannot drive (a feedable iterator, an iterator with
    several initializers, an initializer that needs a feed)."""
    chosen = []
    for op in declared(graph):
        chosen += [o for o in sorted(ancestors(op), key=tf_shim.creation_order) if o.type in INITIALIZER_OPS]
    needed = _needed(step)
    for iterator in _iterators_read(needed):
        chosen.append(_iterator_initializer(iterator, chosen))
    unique = list(dict.fromkeys(chosen))
    for op in unique:
        fed = needed_placeholders(op)
        if fed:
            raise ModelError(f"initializer {op.name!r} ({op.type}) needs placeholder(s) {fed} fed; parallax_tf "
                             "runs initializers without feeds. Build it from constants or numpy arrays "
                             "(e.g. tf.data.Dataset.from_tensor_slices(array), a vocabulary list or file)")
    return unique


def input_reads(graph, step: Iterable) -> List[tf.Operation]:
    """The iterator reads (GetNext) the step runs: one batch each per step."""
    needed = _needed(step)
    return sorted((op for op in needed if op.type in ITERATOR_READ_OPS), key=tf_shim.creation_order)


def batch_rows(reads: List[tf.Operation]):
    """The batch dimension of the first batched tensor the step's iterator reads yield (a
    variant, such as an encoded SparseTensor, says nothing); None when the step reads none."""
    for op in reads:
        for out in op.outputs:
            if out.dtype != tf.variant and out.shape.rank != 0:
                return tf.shape(out, out_type=tf.int64)[0]
    return None


def _iterators_read(needed: set) -> List[tf.Operation]:
    """The iterator resources the needed GetNext ops read."""
    found = []
    for op in sorted(needed, key=tf_shim.creation_order):
        if op.type in FEEDABLE_ITERATOR_OPS:
            raise ModelError(f"the loss reads a feedable iterator ({op.name!r}, Iterator.from_string_handle), whose "
                             "handle must be fed at every step; parallax_tf drives the input itself. Use "
                             "tf.compat.v1.data.make_initializable_iterator(ds) or make_one_shot_iterator(ds), "
                             "or feed batches through placeholders and input_fn")
        if op.type in ITERATOR_READ_OPS:
            source = op.inputs[0].op
            if source.type in ITERATOR_OPS and source not in found:
                found.append(source)
    return found


def _iterator_initializer(iterator: tf.Operation, declared_inits: list):
    """The one MakeIterator of an initializable iterator (a reinitializable iterator has one per
    dataset: the one registered in TABLE_INITIALIZERS, the TF1 idiom, wins)."""
    makers = [op for op in iterator.outputs[0].consumers() if op.type == "MakeIterator"]
    registered = [op for op in makers if op in declared_inits]
    if registered:
        return registered[0]
    if len(makers) == 1:
        return makers[0]
    if not makers:
        raise ModelError(f"iterator {iterator.name!r} has no initializer the graph can run; build it with "
                         "tf.compat.v1.data.make_initializable_iterator(ds) or make_one_shot_iterator(ds)")
    raise ModelError(f"iterator {iterator.name!r} has {len(makers)} initializers ({[m.name for m in makers]}), "
                     "a reinitializable iterator; parallax_tf cannot tell which dataset trains. Add the training "
                     "one to tf.compat.v1.GraphKeys.TABLE_INITIALIZERS, or use make_initializable_iterator(ds)")


def _needed(step) -> set:
    targets = [t if isinstance(t, tf.Operation) else t.op for t in tf.nest.flatten(step)]
    return set().union(*(ancestors(t) for t in targets))
