"""`embedding_column`: a dynamic table as a feature column, the counterpart of
`embedding_column(categorical_column_with_hash_bucket(key, ...), dimension)` without the hash
buckets: tf.compat.v1.feature_column.input_layer (and so a model built on feature columns)
takes it beside its other columns."""
from __future__ import annotations

import tensorflow as tf

from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.dynamic import table as table_lib
from parallax_tf.errors import ModelError


def embedding_column(key: str, dimension: int, combiner: str = "mean", dtype=tf.string, name: str = None,
                     **table_options):
    """A column embedding feature `key` (string or integer ids: a SparseTensor, or a dense
    [batch] or [batch, n] tensor) in a DynamicEmbedding named `name` (default
    "<key>_dynamic_embedding"); several ids of one example combine by `combiner` ("sum",
    "mean", "sqrtn"). `table_options`: DynamicEmbedding's (initializer, admit_after,
    evict_after_steps, capacity, optimizer, seed)."""
    if combiner not in table_lib.COMBINERS:
        raise ModelError(f"embedding_column(combiner={combiner!r}): use one of {', '.join(table_lib.COMBINERS)}")
    dtype = tf.as_dtype(dtype)
    if dtype not in (tf.string, tf.int64, tf.int32):
        raise ModelError(f"embedding_column(dtype={dtype.name}): ids are strings or integers")
    return _column_type()(key, dimension, combiner, dtype, name or f"{key}_dynamic_embedding", table_options)


_COLUMN_TYPE = []


def _column_type() -> type:
    """The column class, made once on TF's own base class (a private name: the shim's)."""
    if _COLUMN_TYPE:
        return _COLUMN_TYPE[0]

    class DynamicEmbeddingColumn(tf_shim.dense_feature_column_base()):
        def __init__(self, key, dimension, combiner, dtype, name, table_options):
            self.key, self.dimension, self.combiner, self.dtype = key, dimension, combiner, dtype
            self._name, self.table_options = name, table_options

        @property
        def name(self):
            return self._name

        @property
        def _parse_example_spec(self):
            return {self.key: tf.io.VarLenFeature(self.dtype)}

        @property
        def _variable_shape(self):
            return tf.TensorShape([self.dimension])

        def _transform_feature(self, inputs):
            return inputs.get(self.key)

        def _get_dense_tensor(self, inputs, weight_collections=None, trainable=None):
            ids = inputs.get(self)
            table = self.table()
            if isinstance(ids, tf.SparseTensor):
                return table.lookup_sparse(ids, self.combiner)
            rows = table.lookup(ids)
            if ids.shape.rank == 1:
                return rows
            total = tf.reduce_sum(rows, 1)
            count = tf.cast(tf.shape(rows)[1], rows.dtype)
            return total if self.combiner == "sum" else total / (count if self.combiner == "mean" else tf.sqrt(count))

        def table(self) -> table_lib.DynamicEmbedding:
            """This graph's table of the column (one, however many input layers read it)."""
            found = [t for t in table_lib.tables() if t.name == self._name]
            return found[0] if found else table_lib.DynamicEmbedding(self._name, self.dimension,
                                                                     **self.table_options)

    _COLUMN_TYPE.append(DynamicEmbeddingColumn)
    return DynamicEmbeddingColumn
