"""DSP's training loop: one rank runs its stage's ticks (rewriters/dsp.py builds the graphs).

At tick t stage k forwards batch t - k and updates with batch t - 2(K-1) + k, each when that
batch exists; the last stage does both for the same batch in one run. Batches [start, steps)
go through in segments that end where a hook saves state (a checkpoint): the pipeline drains
at a segment's end (every batch of it updated at every stage), so a checkpoint holds a state
single-device names can describe and a resumed run continues exactly as an uninterrupted one.
"""
from __future__ import annotations

import dataclasses
import time
from typing import List, Optional, Tuple

import numpy as np
import tensorflow as tf

from parallax_tf.errors import Diverged
from parallax_tf.feeds import make_feeds
from parallax_tf.runtime.hooks import Hook, StepStats
from parallax_tf.runtime.session import batch_size


def ticks(stage: int, stages: int, first: int, end: int, locked: bool = False) -> List[Tuple[Optional[int], Optional[int]]]:
    """(batch forwarded, batch updated with) by `stage` at each tick of the segment of batches
    [first, end); None where the stage has no such batch then (filling and draining). Locked:
    each batch forward and backward through every stage before the next one enters (one run
    per batch and stage; the queues order them)."""
    if locked:
        return [(b, b) for b in range(first, end)]
    lag = 2 * (stages - 1 - stage)
    out = []
    for t in range(end - first + 2 * (stages - 1)):
        forward, backward = first + t - stage, first + t - stage - lag
        out.append((forward if first <= forward < end else None, backward if first <= backward < end else None))
    return out


def segments(start: int, steps: int, hooks) -> List[Tuple[int, int]]:
    """[first, end) ranges of batches, split after every batch where a hook saves state."""
    bounds = [start] + [b for b in range(start + 1, steps) if any(h.saves_at(b) for h in hooks)] + [steps]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def train_pipeline(sess, dgraph, input_fn, ctx, placeholders, start, steps, hooks, tracer, guard, timeout_ms=0,
                   stage_graph=None):
    """session.train for one DSP stage; returns the losses of the batches (as the last stage
    computed them, in batch order) and this rank's tick statistics."""
    graph = stage_graph
    ctx = dataclasses.replace(ctx, rank=graph.pipeline, size=graph.pipelines)    # each pipeline reads a shard
    stats = StepStats()
    losses: List[float] = []
    options = tf.compat.v1.RunOptions(timeout_in_ms=timeout_ms)
    first_stage = graph.stage == 0
    watching = [h for h in hooks if not _saves(h)]      # progress, summaries: per batch, rank 0
    try:
        for first, end in segments(start, steps, hooks):
            updating = {j: [b is not None for _, b in ticks(j, graph.stages, first, end)] for j in graph.joins}
            for t, (forward, backward) in enumerate(ticks(graph.stage, graph.stages, first, end, graph.locked)):
                joins = [op for j, ops in graph.joins.items() if updating[j][t] for op in ops]
                if forward is None and backward is None and not joins:
                    continue
                began, moved, rows = time.perf_counter(), 0, 0
                feeds = {}
                if forward is not None and first_stage:
                    ctx.step = forward
                    feeds = make_feeds(input_fn, ctx, placeholders, dgraph.graph)
                    rows = batch_size(feeds)
                if forward is not None and graph.forward is not None:     # the last stage and locked ones: one run
                    with guard(f"stage {graph.stage}: forward of batch {forward}"):
                        out = sess.run(graph.forward, {**feeds, graph.forward_batch: forward}, options=options)
                    moved += int(out["bytes"])
                    rows = rows or int(out["rows"])
                    feeds = {}
                if backward is None and joins:      # other stages' replicas average their gradients
                    with guard(f"stage {graph.stage}: tick {t} of batches [{first}, {end}), averaging other stages"):
                        sess.run(joins, options=options)
                if backward is not None:
                    feeds.update({graph.forward_batch: backward, graph.backward_batch: backward})
                    with guard(f"stage {graph.stage}: backward of batch {backward}"):
                        out = sess.run(dict(graph.backward, joins=joins), feeds, options=options)
                    moved += int(out["bytes"])
                    rows = rows or int(out.get("rows", 0))
                    loss = float(out["loss"])
                    losses.append(loss)
                    if not np.isfinite(loss):
                        raise Diverged(f"stage {graph.stage}: the loss of batch {backward} is {loss}; training stopped "
                                       "before it could be checkpointed. Lower the learning rate or check the input, "
                                       "then restart from the last checkpoint")
                stats.add(time.perf_counter() - began, {"activations": moved}, rows * ctx.size)
                if backward is not None:
                    for hook in watching:
                        hook.after_step(backward + 1, loss, stats)
            with guard(f"stage {graph.stage}: checking the pipeline drained"):
                left = sess.run(graph.stored)
            if len(left):
                raise RuntimeError(f"stage {graph.stage}: inputs of batches {list(left)} are still stored after "
                                   f"batches [{first}, {end}) drained; the schedule is broken")
            for hook in hooks:          # every rank at once: reading owned state is collective
                if _saves(hook) and end < steps:
                    hook.after_step(end, losses[-1] if losses else float("nan"), stats)
    finally:
        tracer.write()
    for hook in hooks:
        hook.end(steps)
    return losses, stats


def _saves(hook) -> bool:
    """Whether the hook saves state (then every rank calls it, and only when drained)."""
    return type(hook).saves_at is not Hook.saves_at
