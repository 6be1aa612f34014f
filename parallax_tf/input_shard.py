"""Sharding the tf.data pipeline model_fn builds itself, as TF's own strategies do (DATA auto-sharding).

While model_fn runs (training_graph.build), each dataset turned into an iterator is replaced by
`dataset.shard(ctx.size, ctx.rank)` of the whole pipeline as built (after batch and prefetch):
rank r of N reads batches r, r+N, r+2N, ..., so a global step trains on the single-device
script's next N batches. A dataset whose options set
`experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF` (a
pipeline already split by ctx.rank) is left whole, as TF's strategies leave it. The patches
hold for the call only and are restored on exit, error or not.
"""
from __future__ import annotations

import contextlib
import sys
import warnings

import tensorflow as tf

from parallax_tf import graph_walk
from parallax_tf.compat import tensorflow as tf_shim

# iterator names already warned about in this process: model_fn runs at inspection and again
# at each rewrite, and one warning says it all
_WARNED: set = set()


class Scope:
    """What one model_fn call shards, and which iterators it made (by op name)."""

    def __init__(self, ctx, shard: bool):
        self.ctx = ctx
        self.active = bool(shard) and ctx.size > 1
        self.made: set = set()

    def shard(self, dataset):
        if not tf_shim.is_dataset(dataset) or _opted_out(dataset):
            return dataset      # not a dataset: TF's own call raises the real error
        return dataset.shard(self.ctx.size, self.ctx.rank)

    def record(self, iterator):
        self.made.add(tf_shim.iterator_resource(iterator).op.name)
        return iterator

    def warn_unsharded(self, needed: set) -> None:
        """One line on rank 0 for each iterator the step (ops `needed`) reads that was not made
        here: it cannot be sharded, so every rank reads the same batches."""
        if not self.active or self.ctx.rank != 0:
            return
        for op in sorted(needed, key=lambda o: o.name):
            if op.type not in graph_walk.ITERATOR_READ_OPS:
                continue
            source = graph_walk.feeding_op(op.inputs[0], graph_walk.HANDLE_PASS_THROUGH_OPS)
            if source.type in graph_walk.FEEDABLE_ITERATOR_OPS or source.name in self.made or source.name in _WARNED:
                continue
            _WARNED.add(source.name)
            print(f"parallax_tf: warning: the tf.data iterator {source.name!r} was not made by make_one_shot_iterator/"
                  "make_initializable_iterator, so it is not sharded: every rank reads the same batches",
                  file=sys.stderr, flush=True)


def _opted_out(dataset) -> bool:
    # TF warns that graph-mode options are read the legacy way: that is how this pipeline set them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        policy = dataset.options().experimental_distribute.auto_shard_policy
    return policy == tf.data.experimental.AutoShardPolicy.OFF


@contextlib.contextmanager
def sharding(ctx, shard: bool = True):
    """Within: every dataset made into an iterator is read by ctx's ranks in turn (with `shard`
    and more than one data rank). Yields the Scope, whose warn_unsharded checks the step."""
    scope = Scope(ctx, shard)
    if not scope.active:
        yield scope
        return
    saved = [(owner, name, vars(owner)[name]) for owner, name in tf_shim.iterator_makers()]
    one_shot, initializable, make_initializer = (original for _, _, original in saved)

    def make_one_shot_iterator(dataset):
        return scope.record(one_shot(scope.shard(dataset)))

    def make_initializable_iterator(dataset, shared_name=None):
        return scope.record(initializable(scope.shard(dataset), shared_name))

    def make_initializer_of(iterator, dataset, name=None):
        scope.record(iterator)
        return make_initializer(iterator, scope.shard(dataset), name)

    for (owner, name, _), patch in zip(saved, (make_one_shot_iterator, make_initializable_iterator,
                                               make_initializer_of)):
        setattr(owner, name, patch)
    try:
        yield scope
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
