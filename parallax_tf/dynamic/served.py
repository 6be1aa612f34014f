"""A dynamic table in a served model: its live rows as two variables restored from the
checkpoint's `<table>/ids` (ascending) and `<table>/values`, an id's row found by binary search
(tf.searchsorted). Standard ops and no table to initialise, so TF Serving, tf.saved_model.load
and a process without parallax_tf load it, with any number of rows (none included). An id
without a row reads what training would have read: its initial row when ids are admitted on
first use, else zeros."""
from __future__ import annotations

import tensorflow as tf


class ServedRows:
    def __init__(self, name: str, options):
        self.options = options
        graph = tf.compat.v1.get_default_graph()
        with tf.control_dependencies(None), graph.name_scope(None):
            # named as the checkpoint's keys, at the top level whatever scope model_fn is in
            self.ids = tf.compat.v1.Variable(tf.zeros([0], tf.int64), shape=tf.TensorShape([None]),
                                             trainable=False, name=f"{name}/ids", use_resource=True)
            self.values = tf.compat.v1.Variable(tf.zeros([0, options.dim], options.dtype),
                                                shape=tf.TensorShape([None, options.dim]), trainable=False,
                                                name=f"{name}/values", use_resource=True)

    def read(self, ids: tf.Tensor) -> tf.Tensor:
        return read_live(self.ids, self.values, self.options, ids)


def read_live(live_ids, live_values, options, ids: tf.Tensor) -> tf.Tensor:
    """The rows of int64 `ids` ([n] -> [n, dim]) from a table's live rows (variables of its
    ascending ids and their values), by binary search; an id without a row reads what training
    would."""
    live = live_ids.read_value()
    at = tf.searchsorted(live, ids)
    padded_ids = tf.concat([live, tf.zeros([1], tf.int64)], 0)
    found = tf.logical_and(at < tf.size(live), tf.equal(tf.gather(padded_ids, at), ids))
    padded = tf.concat([live_values.read_value(), tf.zeros([1, options.dim], options.dtype)], 0)
    stored = tf.gather(padded, tf.where(found, at, tf.size(live)))
    fresh = (options.initializer.rows(ids, options.dim, options.seed, options.dtype, standard_ops=True)
             if options.admit_after == 1 else tf.zeros_like(stored))
    return tf.where(found[:, None], stored, fresh)
