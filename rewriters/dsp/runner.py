"""DSP's runner: one rank runs its stage's ticks (schedule.py) on the graphs rewrite.py builds.

At tick t stage k forwards batch t - k and updates with batch t - 2(K-1) + k, each when that
batch exists; the last stage does both for the same batch in one run. Batches [start, steps)
go through in segments that end where a hook saves state (a checkpoint): the pipeline drains
at a segment's end (every batch of it updated at every stage), so a checkpoint holds a state
single-device names can describe and a resumed run continues exactly as an uninterrupted one.
"""
from __future__ import annotations

import time
from typing import List

import tensorflow as tf

from parallax_tf.feeds import batch_size
from parallax_tf.runtime.hooks import Hook, StepStats
from parallax_tf.runtime.runner import Runner, RunInputs
from rewriters.dsp.schedule import segments, ticks


class PipelineRunner(Runner):
    """Runs one DSP stage's ticks; its losses are the batches' (as the last stage computed them, in
    batch order)."""

    def __init__(self, stage_graph):
        self.graph = stage_graph

    def train(self, sess, inputs: RunInputs, stats: StepStats) -> List[float]:
        graph, guard, hooks, steps = self.graph, inputs.guard, inputs.hooks, inputs.steps
        ctx = inputs.data_ctx(graph.pipeline, graph.pipelines)     # each pipeline reads a shard
        losses: List[float] = []
        options = tf.compat.v1.RunOptions(timeout_in_ms=inputs.timeout_ms)
        first_stage = graph.stage == 0
        watching = [h for h in hooks if not _saves(h)]      # progress, summaries: per batch, rank 0
        for first, end in segments(inputs.start, steps, hooks):
            updating = {j: [b is not None for _, b in ticks(j, graph.stages, first, end)] for j in graph.joins}
            for t, (forward, backward) in enumerate(ticks(graph.stage, graph.stages, first, end, graph.locked)):
                joins = [op for j, ops in graph.joins.items() if updating[j][t] for op in ops]
                if forward is None and backward is None and not joins:
                    continue
                began, moved, rows = time.perf_counter(), 0, 0
                feeds = {}
                if forward is not None and first_stage:
                    feeds = self.feeds(inputs, sess, ctx, forward)
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
                    self.check_finite(loss, f"stage {graph.stage}: the loss of batch {backward}")
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
        return losses


def _saves(hook) -> bool:
    """Whether the hook saves state (then every rank calls it, and only when drained)."""
    return type(hook).saves_at is not Hook.saves_at
