"""Stanza's runner: synchronous steps in which conv nodes read their data shard (input_fn's ctx
counts conv nodes only) and FC nodes read no data."""
from __future__ import annotations

from parallax_tf.runtime.runner import SyncRunner


def data_shard(split, rank: int):
    """(shard, shards) a rank reads: conv nodes are the data shards; None for an FC node."""
    return (split.conv_ranks.index(rank), len(split.conv_ranks)) if rank in split.conv_ranks else None


class SplitRunner(SyncRunner):
    def __init__(self, loss, train_op, step, split):
        super().__init__(loss, train_op, step, data_shard=lambda ctx: data_shard(split, ctx.rank))
