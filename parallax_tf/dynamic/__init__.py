"""Dynamic embedding tables: rows created for the ids a model meets, admitted after k
occurrences, evicted when unseen or over capacity (docs/strategies.md, "Dynamic tables")."""
from parallax_tf.dynamic.columns import embedding_column
from parallax_tf.dynamic.ids import STRING_BUCKETS, as_int64, constant, normal, uniform
from parallax_tf.dynamic.layer import start_values
from parallax_tf.dynamic.table import (DynamicEmbedding, describe_tables, id_counts, serving, sharded_over, step,
                                      tables)

__all__ = ["DynamicEmbedding", "embedding_column", "step", "uniform", "normal", "constant", "as_int64",
           "STRING_BUCKETS", "tables", "describe_tables", "id_counts", "sharded_over", "serving", "start_values"]
