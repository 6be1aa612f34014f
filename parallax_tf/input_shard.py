"""Sharding the tf.data pipelines model_fn builds itself, as TF's own strategies decide it.

TF auto-shards a dataset that does not depend on the worker (`experimental_distribute_dataset`)
and never one built from the input context (`distribute_datasets_from_function`): that one is
the script's to split. model_fn(ctx) is both forms at once, so each pipeline is judged by what
it is. While model_fn runs (training_graph.build), every dataset turned into an iterator is one
*pipeline*, numbered in the order model_fn makes them, and is

- left as the script built it when it already depends on the rank: it holds a shard by the
  job's size (`ds.shard(hvd.size(), hvd.rank())`), its options turn auto-sharding off
  (`AutoShardPolicy.OFF`), or it differs when built for another rank (data chosen by
  `ctx.rank`, `ds.shard(ctx.size, ctx.rank)`, a file per rank);
- otherwise read by the data ranks in turn: `dataset.shard(ctx.size, ctx.rank)` of the whole
  pipeline as built (after batch and prefetch), so rank r of N reads batches r, r+N, ... and a
  global step trains on the single-device script's next N batches.

Whether a pipeline differs by rank is only asked when model_fn read `ctx.rank` (or
`ctx.local_rank`) before making it: inspection then builds model_fn once more, for rank 1, in a
graph of its own, and compares the two pipelines' ops and constants. A pipeline that runs Python
(`from_generator`, `py_function`) hides what it reads: after a read of the rank it counts as
the script's own. Inspection decides on rank 0 (`decide`); the plan carries one
`InputDecision` per pipeline, and each rank's rewrite applies them (`apply`). The patches of
TF's iterator makers hold for one model_fn call only and are restored on exit, error or not.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import sys
import warnings
from typing import Callable, List, Optional

import tensorflow as tf

from parallax_tf import graph_walk
from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.model import RunContext
from parallax_tf.plan import InputDecision

# iterator names already warned about in this process: model_fn runs at inspection and again
# at each rewrite, and one warning says it all
_WARNED: set = set()
# attributes that differ between two builds of one pipeline without changing what it reads
_UNSTABLE_ATTRS = frozenset({"_class", "shared_name", "container", "metadata", "token"})


@dataclasses.dataclass
class _Pipeline:
    iterator: str
    fingerprint: str
    decision: InputDecision
    after_rank_read: bool       # model_fn had read ctx.rank when it made this pipeline's iterator
    runs_python: bool


class _WatchedContext(RunContext):
    """model_fn's ctx, noting whether model_fn has read its rank yet."""

    def __getattribute__(self, name):
        if name in ("rank", "local_rank"):
            object.__setattr__(self, "_rank_read", True)
        return object.__getattribute__(self, name)


def _watched(ctx: RunContext) -> _WatchedContext:
    watched = _WatchedContext(**dataclasses.asdict(ctx))
    object.__setattr__(watched, "_rank_read", False)
    return watched


def _rank_read(ctx) -> bool:
    return isinstance(ctx, _WatchedContext) and object.__getattribute__(ctx, "_rank_read")


class Scope:
    """The pipelines of one model_fn call: `decisions` given (a rank's rewrite) or to be made
    (inspection, `decide`). `ctx` is the one model_fn gets."""

    def __init__(self, ctx: RunContext, shard: bool, decisions: Optional[List[InputDecision]] = None):
        self.size, self.rank = ctx.size, ctx.rank
        self.ctx = _watched(ctx)
        self.shard_input = bool(shard)
        self.given = decisions
        self.pipelines: List[_Pipeline] = []

    def take(self, dataset):
        """The dataset an iterator maker binds: this pipeline, sharded or not."""
        if not tf_shim.is_dataset(dataset):
            return dataset      # not a dataset: TF's own call raises the real error
        index = len(self.pipelines)
        if self.given is not None:
            decision = self.given[index] if index < len(self.given) else \
                InputDecision("?", False, "not built at inspection: read as built")
            pipeline = _Pipeline("", "", decision, False, False)
        else:
            pipeline = self._judge(dataset)
        self.pipelines.append(pipeline)
        return dataset.shard(self.size, self.rank) if pipeline.decision.sharded else dataset

    def record(self, iterator):
        pipeline = self.pipelines[-1] if self.pipelines else None
        if pipeline is not None and not pipeline.iterator:
            pipeline.iterator = tf_shim.iterator_resource(iterator).op.name
            pipeline.decision.iterator = pipeline.decision.iterator if self.given is not None else pipeline.iterator
        return iterator

    def _judge(self, dataset) -> _Pipeline:
        ops = _pipeline_ops(dataset)
        digest = _Digest(ops)
        runs_python = bool(digest.op_types & graph_walk.PY_FUNC_OPS)
        after_read = _rank_read(self.ctx)
        decision = InputDecision("", False, "")
        if self.size <= 1:
            decision.why = "one data rank"
        elif not self.shard_input:
            decision.why = "--noshard_input"
        elif _opted_out(dataset):
            decision.why = "its options set AutoShardPolicy.OFF"
        elif _shards_by(ops, self.size):
            decision.why = f"it already holds a shard by the job's size ({self.size})"
        elif after_read and runs_python:
            decision.why = "model_fn read ctx.rank before making it, and it runs Python the toolkit cannot see into"
        else:
            decision.sharded = True
            decision.why = "it does not depend on the rank"
        return _Pipeline("", digest.hexdigest(), decision, after_read, runs_python)

    def unsure(self) -> bool:
        """Some pipeline was made after model_fn read its rank and is to be sharded: whether it
        depends on the rank takes a build for another rank (`compare`)."""
        return any(p.after_rank_read and p.decision.sharded for p in self.pipelines)

    def compare(self, other: "Scope") -> None:
        """Leaves as built each pipeline that differs in `other`, a build of model_fn for another rank."""
        if len(other.pipelines) != len(self.pipelines):
            for pipeline in self.pipelines:
                if pipeline.decision.sharded:
                    pipeline.decision.sharded = False
                    pipeline.decision.why = (f"model_fn makes {len(self.pipelines)} pipeline(s) for rank {self.rank} "
                                             f"and {len(other.pipelines)} for rank {other.rank}")
            return
        for mine, theirs in zip(self.pipelines, other.pipelines):
            if mine.decision.sharded and mine.after_rank_read and mine.fingerprint != theirs.fingerprint:
                mine.decision.sharded = False
                mine.decision.why = "it depends on ctx.rank (built for rank 1, it reads other data)"

    def decisions(self) -> List[InputDecision]:
        return [p.decision for p in self.pipelines]

    def warn_unsharded(self, needed: set) -> None:
        """One line on rank 0 for each iterator the step (ops `needed`) reads that was not made
        here: it cannot be sharded, so every rank reads the same batches."""
        if not self.shard_input or self.size <= 1 or self.rank != 0:
            return
        made = {p.iterator for p in self.pipelines}
        for op in sorted(needed, key=lambda o: o.name):
            if op.type not in graph_walk.ITERATOR_READ_OPS:
                continue
            source = graph_walk.feeding_op(op.inputs[0], graph_walk.HANDLE_PASS_THROUGH_OPS)
            if source.type in graph_walk.FEEDABLE_ITERATOR_OPS or source.name in made or source.name in _WARNED:
                continue
            _WARNED.add(source.name)
            print(f"parallax_tf: warning: the tf.data iterator {source.name!r} was not made by make_one_shot_iterator/"
                  "make_initializable_iterator, so it is not sharded: every rank reads the same batches",
                  file=sys.stderr, flush=True)


def _pipeline_ops(dataset) -> list:
    """The ops that compute the dataset, in the order the graph made them."""
    variant = tf_shim.dataset_variant(dataset)
    if not isinstance(variant, tf.Tensor) or not hasattr(variant, "op") or variant.graph is None:
        return []
    found = graph_walk.ancestors(variant.op) | {variant.op}
    return sorted(found, key=tf_shim.creation_order)


def _shards_by(ops, size: int) -> bool:
    """Whether a ShardDataset in the pipeline splits it into `size` shards (a constant count)."""
    for op in ops:
        if op.type in graph_walk.SHARD_DATASET_OPS:
            count = tf.get_static_value(op.inputs[1])
            if count is not None and int(count) == size:
                return True
    return False


class _Digest:
    """What a pipeline computes, as a digest of each op's type, inputs and attributes (constants'
    values, and the functions it calls by their bodies), without the names two builds of it give
    differently; and every op type it runs, inside its functions too."""

    def __init__(self, ops):
        self.hash = hashlib.sha256()
        self.op_types: set = set()
        position = {op.name: i for i, op in enumerate(ops)}
        for op in ops:
            self._node(op.type, [f"{position.get(t.op.name, -1)}:{t.value_index}" for t in op.inputs],
                       op.node_def.attr, op.graph, 0)

    def hexdigest(self) -> str:
        return self.hash.hexdigest()

    def _node(self, op_type: str, inputs, attrs, graph, depth: int) -> None:
        self.op_types.add(op_type)
        self.hash.update(op_type.encode())
        for name in inputs:
            self.hash.update(f"<{name}".encode())
        for key in sorted(attrs):
            if key in _UNSTABLE_ATTRS:
                continue
            value = attrs[key]
            self.hash.update(key.encode())
            called = [value.func] if value.HasField("func") else list(value.list.func)
            if not called:
                self.hash.update(value.SerializeToString(deterministic=True))
            for function in called:
                self._function(function, graph, depth)

    def _function(self, called, graph, depth: int) -> None:
        definition = tf_shim.function_definition(graph, called.name) if depth < 8 else None
        if definition is None:
            self.hash.update(b"<function>")
            return
        for key in sorted(called.attr):
            self.hash.update(key.encode() + called.attr[key].SerializeToString(deterministic=True))
        for node in definition.node_def:
            self._node(node.op, node.input, node.attr, graph, depth + 1)


def _opted_out(dataset) -> bool:
    # TF warns that graph-mode options are read the legacy way: that is how this pipeline set them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        policy = dataset.options().experimental_distribute.auto_shard_policy
    return policy == tf.data.experimental.AutoShardPolicy.OFF


@contextlib.contextmanager
def sharding(ctx: RunContext, shard: bool = True, decisions: Optional[List[InputDecision]] = None):
    """Within: every dataset made into an iterator is one pipeline of the yielded Scope, sharded
    as `decisions` say, or (None) as the Scope decides. Model_fn is to be called with `scope.ctx`."""
    scope = Scope(ctx, shard, decisions)
    saved = [(owner, name, vars(owner)[name]) for owner, name in tf_shim.iterator_makers()]
    one_shot, initializable, make_initializer = (original for _, _, original in saved)

    def make_one_shot_iterator(dataset):
        return scope.record(one_shot(scope.take(dataset)))

    def make_initializable_iterator(dataset, shared_name=None):
        return scope.record(initializable(scope.take(dataset), shared_name))

    def make_initializer_of(iterator, dataset, name=None):
        made = make_initializer(iterator, scope.take(dataset), name)
        scope.record(iterator)
        return made

    for (owner, name, _), patch in zip(saved, (make_one_shot_iterator, make_initializable_iterator,
                                               make_initializer_of)):
        setattr(owner, name, patch)
    try:
        yield scope
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def decide(scope: Scope, build_for_rank: Callable[[RunContext], "Scope"]) -> List[InputDecision]:
    """Inspection's decisions for the pipelines of `scope`: when one may depend on the rank,
    `build_for_rank(ctx)` builds model_fn again for rank 1 and returns that build's Scope."""
    if scope.unsure():
        other = RunContext(**{**{f.name: getattr(scope.ctx, f.name) for f in dataclasses.fields(RunContext)},
                              "rank": 1 if scope.rank != 1 else 0})
        scope.compare(build_for_rank(other))
    return scope.decisions()
