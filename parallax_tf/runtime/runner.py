"""The runner protocol: how one rank trains the graph its rewriter built.

`Runner.run(session, inputs)` trains steps [inputs.start, inputs.steps) and returns this rank's
losses and step statistics. `RunInputs` bundles what every runner gets; `Runner` is the shared
base (feeds, the divergence check, hooks, tracing); `SyncRunner` is synchronous data
parallelism, one session run per step. Techniques whose step is not that (asynchronous pushes,
a pipeline's ticks, a layer split's data shards) bring their own runner built on this base, in
their package.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, List, Optional

import numpy as np

from parallax_tf.errors import Diverged
from parallax_tf.feeds import batch_size, make_feeds
from parallax_tf.model import RunContext
from parallax_tf.runtime import rank_objects
from parallax_tf.runtime.hooks import Hook, StepStats
from parallax_tf.runtime.step_call import StepCall


@dataclasses.dataclass
class RunInputs:
    """What a runner gets besides the session."""
    input_fn: Optional[Callable]
    ctx: RunContext           # this rank's; `data_ctx` is the one input_fn sees
    placeholders: List[str]   # the placeholders the loss needs fed
    start: int                # the global step training starts at (a resume's)
    steps: int                # train until the global step reaches it
    hooks: List[Hook]
    tracer: object            # hooks.StepTracer
    guard: Callable           # guard(what) -> context naming a lost peer (session.cross_rank_errors)
    timeout_ms: int = 0       # every session run's deadline
    # the batch dimension of what the step reads from tf.data (None: no iterator read); fed
    # batches are counted from the feed
    batch_rows: object = None
    profile_threads_from: int = -1   # from this many completed steps on, CPU per thread name is counted
    # the steps whose bytes per route and lower bound are counted: the first, then every this many
    measure_every: int = 1

    def measures(self, step: int) -> bool:
        return (step - self.start) % self.measure_every == 0

    def data_ctx(self, rank: int, size: int) -> RunContext:
        """The context input_fn sees when this rank reads shard `rank` of `size`."""
        return dataclasses.replace(self.ctx, rank=rank, size=size)


class Runner:
    """Shared base. A subclass implements `train(session, inputs, stats)` and returns the losses."""

    def run(self, session, inputs: RunInputs):
        stats = StepStats(inputs.profile_threads_from)
        try:
            losses = self.train(session, inputs, stats)
        finally:
            inputs.tracer.write()
        end = inputs.start + len(stats.times) if stats.stop_requested else inputs.steps
        for hook in inputs.hooks:      # only after a clean finish: never checkpoint a broken state
            hook.end(end)
        return losses, stats

    def train(self, session, inputs: RunInputs, stats: StepStats) -> List[float]:
        raise NotImplementedError

    def final_report(self, session) -> dict:
        """Once every rank's updates are in: {"histograms": {name: {rank: {bucket: count}}},
        "extras": {...}} (Result.histograms, Result.extras)."""
        return {}

    @staticmethod
    def feeds(inputs: RunInputs, session, ctx: Optional[RunContext], step: int) -> dict:
        """input_fn's batch for `step` as read by `ctx` (None: this rank reads no data)."""
        if ctx is None:
            return make_feeds(None, inputs.ctx, [], session.graph)
        ctx.step = step
        return make_feeds(inputs.input_fn, ctx, inputs.placeholders, session.graph)

    @staticmethod
    def rows_fetch(inputs: RunInputs) -> dict:
        """What a step fetches besides its own targets to count the examples it read."""
        return {} if inputs.batch_rows is None else {"rows": inputs.batch_rows}

    @staticmethod
    def rows_read(input_feeds: dict, out: dict) -> int:
        """Examples this rank's step consumed: input_fn's batch (before the step adds feeds of its
        own), else the batch the step read from tf.data."""
        return batch_size(input_feeds) or int(out.get("rows", 0))

    @staticmethod
    def check_finite(loss: float, subject: str, when: str = "", all_ranks: bool = False) -> None:
        """Stops the run with a Diverged error naming `subject` (the loss) and `when`. `all_ranks`:
        every rank of the job sees the same loss and stops at this step too."""
        if not np.isfinite(loss):
            error = Diverged(f"{subject} is {loss}{when}; training stopped before it could be checkpointed. Lower "
                             "the learning rate or check the input, then restart from the last checkpoint")
            if all_ranks:
                error.after_report = _every_rank_reported
            raise error


@dataclasses.dataclass
class SyncStep:
    """The graph pieces of a synchronous step besides the train op (rewriters' StepReport)."""
    report: object                        # [loss, checkpoint requests, metrics, previous bytes per route] summed over ranks
    report_routes: List[str]
    checkpoint_request: object            # placeholder (default 0): rank 0 asks for a checkpoint
    previous_bytes: object                # placeholder: this rank's bytes of the last step, by report_routes
    bytes_per_step: Dict[str, object]     # route -> bytes this rank moved in the step
    lower_bound_bytes: object             # the least the plan's variables need per step
    # Work done after some steps (a communication round): step -> (extra targets run in the same
    # session run as that step's, their feeds).
    scheduled: Callable[[int], tuple] = lambda step: ([], {})
    metric_names: List[str] = dataclasses.field(default_factory=list)   # Model.metrics in the report
    metric_sizes: List[int] = dataclasses.field(default_factory=list)   # their elements (1: a scalar)
    # rank 0: per dynamic table, [rows, admitted, evicted] once the step's boundaries ran
    tables: Dict[str, object] = dataclasses.field(default_factory=dict)


class SyncRunner(Runner):
    """Every rank runs one step in one session run; the step's collectives keep them together."""

    def __init__(self, loss, train_op, step: SyncStep, data_shard: Optional[Callable[[RunContext], Optional[tuple]]] = None):
        """`data_shard(ctx)`: the (shard, shards) this rank reads, None for no data (default: one
        shard per rank)."""
        self.loss, self.train_op, self.step = loss, train_op, step
        self.data_shard = data_shard or (lambda ctx: (ctx.rank, ctx.size))

    def train(self, session, inputs: RunInputs, stats: StepStats) -> List[float]:
        spec, ctx = self.step, inputs.ctx
        shard = self.data_shard(ctx)
        reads = shard is not None
        data_ctx = inputs.data_ctx(*shard) if reads else ctx
        losses: List[float] = []
        fetches = {"loss": self.loss, "report": spec.report, "train": self.train_op,
                   **({"tables": spec.tables} if spec.tables else {}),
                   **(self.rows_fetch(inputs) if reads else {})}
        # the counting ops run only when fetched (inputs.measures)
        counted = dict(fetches, bytes=spec.bytes_per_step, lower_bound=spec.lower_bound_bytes)
        call = StepCall(session, inputs.timeout_ms)
        unmeasured = [0.0] * len(spec.report_routes)
        previous_bytes, previous_measured = unmeasured, False     # the report sums the last step's
        for step in range(inputs.start, inputs.steps):
            ctx.step = step
            feeds = self.feeds(inputs, session, data_ctx if reads else None, step)
            input_feeds = dict(feeds)
            feeds[spec.checkpoint_request] = sum(hook.request(step + 1) for hook in inputs.hooks)
            feeds[spec.previous_bytes] = previous_bytes
            extra_targets, extra_feeds = spec.scheduled(step)
            feeds.update(extra_feeds)
            options, metadata = inputs.tracer.options(step)
            if options is not None:
                # A whole step has a deadline too (StepCall's has it always): a Horovod collective
                # that never completes is not covered by the session's operation timeout.
                options.timeout_in_ms = inputs.timeout_ms
            begin = time.perf_counter()
            measured = inputs.measures(step)
            with inputs.guard(f"step {step}"):
                out = call.run(dict(counted if measured else fetches, extra=extra_targets), feeds, options=options,
                               run_metadata=metadata)
            report = out["report"]
            mean_loss = report[0]          # every rank added its share
            metrics, metrics_end = _metrics_of(report, spec)
            stats.add(time.perf_counter() - begin, out.get("bytes"), self.rows_read(input_feeds, out) * data_ctx.size,
                      out.get("lower_bound"), dict(zip(spec.report_routes, report[metrics_end:])) if previous_measured
                      else None, loss=float(mean_loss), metrics=metrics)
            previous_bytes = [float(out["bytes"][route]) for route in spec.report_routes] if measured else unmeasured
            previous_measured = measured
            stats.tables = {name: [int(n) for n in counts] for name, counts in out.get("tables", {}).items()}
            stats.checkpoint_requested = report[1] > 0
            inputs.tracer.record(step, metadata)
            losses.append(float(out["loss"]))
            # The mean over ranks decides, so every rank stops at the same step.
            self.check_finite(mean_loss, "the loss (mean over ranks)", f" at step {step + 1}", all_ranks=ctx.size > 1)
            for hook in inputs.hooks:
                hook.after_step(step + 1, float(mean_loss), stats)
            if stats.stop_requested:
                break
        return losses


def _metrics_of(report, spec: SyncStep):
    """({name: mean over ranks, a float or, for a vector metric, an array}, where the bytes begin)."""
    metrics, at = {}, 2
    for name, size in zip(spec.metric_names, spec.metric_sizes or [1] * len(spec.metric_names)):
        metrics[name] = float(report[at]) if size == 1 else np.array(report[at:at + size])
        at += size
    return metrics, at


def _every_rank_reported() -> None:
    """A barrier of the ranks that diverged together, once each has printed why."""
    rank_objects.allgather(True)
