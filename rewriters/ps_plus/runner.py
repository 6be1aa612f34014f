"""PS+'s runner: the training loop of a rank that pushes and pulls asynchronously (ranks never
wait for each other: no per-step collective, no barrier, no token).

Three threads share one session:
- the trainer runs steps on the rank's local copy and drops each step's update into the
  outbox (a queue of one on this rank's worker), so it never waits for the network;
- the pusher empties the outbox into the servers, one push per run (the servers apply it);
- the puller, whenever the global version moved past its copy (each push's answer says where
  it is now), reads the global values into whichever of two buffers the trainer is not about
  to read. Between steps the trainer swaps the newest buffer into its local copy.
A copy more than `max_staleness` versions behind (counting this rank's own pushes still in the
outbox) makes the trainer wait for a fresh pull: bounded staleness. Every wait is bounded by
--timeout_s and says what it waited for. Training stops once the pushes applied and in flight
reach `steps` (the global step counts applied pushes): each step first takes a ticket from a
counter on the servers, and a rank whose ticket is past `steps` stops, so the ranks together
push exactly `steps` times.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import List, Optional

import tensorflow as tf

from parallax_tf.runtime.hooks import StepStats
from parallax_tf.runtime.runner import Runner, RunInputs
from parallax_tf.runtime.session import PeerLost

STALENESS_BUCKETS = 64   # the servers count pushes by staleness 0..62 and >= 63


@dataclasses.dataclass
class AsyncSpec:
    """The graph pieces of an asynchronous push/pull rank (built by its rewriter)."""
    claim: tf.Tensor                # takes the next step's ticket (1, 2, ...) from a shared counter
    step_targets: list              # per step: the update into the outbox, the model-state updates
    step_bytes: tf.Tensor           # bytes the step's update and in-step server reads move
    push: dict                      # one outbox entry into the servers: {"staleness", "version"}
    close_outbox: tf.Operation
    global_version: tf.Tensor       # the global step: advanced once per applied push
    pulls: List[tf.Tensor]          # two: global values -> buffer b; each returns the newest version read
    swaps: List[tf.Operation]       # two: local copy <- buffer b
    pull_bytes: int                 # bytes one pull moves
    max_staleness: int
    route: str                      # the bytes are reported under this route
    histogram: tf.Tensor = None     # [ranks, STALENESS_BUCKETS]: pushes applied by rank and staleness
    task_versions: dict = None      # server task -> its version (every push advances each once)


class _Shared:
    """What the three threads share, under one condition variable."""

    def __init__(self):
        self.cond = threading.Condition()
        self.applied_version = 0       # global version after this rank's last applied push
        self.pending = 0               # this rank's pushes in the outbox or on their way
        self.seen_version = 0          # newest global version the puller has seen
        self.ready: Optional[int] = None   # buffer holding the newest pull not yet swapped in
        self.ready_version = -1
        self.pulled_bytes = 0
        self.staleness = collections.Counter()     # pushes by the staleness the servers measured
        self.copy_lag = collections.Counter()      # steps by how far behind their copy was at the start
        self.error: Optional[BaseException] = None
        self.stop = False


def _pusher(sess, spec: AsyncSpec, shared: _Shared, timeout_ms: int) -> None:
    options = tf.compat.v1.RunOptions(timeout_in_ms=timeout_ms)
    try:
        while True:
            try:
                out = sess.run(spec.push, options=options)
            except tf.errors.OutOfRangeError:     # outbox closed and empty: done
                return
            with shared.cond:
                shared.applied_version = max(shared.applied_version, int(out["version"]))
                shared.pending -= 1
                shared.staleness[int(out["staleness"])] += 1
                shared.cond.notify_all()
    except BaseException as err:   # handed to the trainer, which raises it
        with shared.cond:
            shared.error = shared.error or err
            shared.cond.notify_all()


def _puller(sess, spec: AsyncSpec, shared: _Shared, have: int, timeout_ms: int) -> None:
    """Pulls whenever the global version moved past the copy it has. It learns that from the
    answer to each of this rank's pushes (the version after it) and from its own pulls, so it
    never polls the servers: with many ranks, polling alone would saturate PS task 0."""
    options = tf.compat.v1.RunOptions(timeout_in_ms=timeout_ms)
    last_buffer = 0
    try:
        while True:
            with shared.cond:
                shared.cond.wait_for(lambda: shared.stop or shared.applied_version > have)
                if shared.stop:
                    return
                # the buffer the trainer is not going to read: not the one published last
                target = 1 - last_buffer
                if shared.ready == target:          # never overwrite what is published
                    target = 1 - target
            have = int(sess.run(spec.pulls[target], options=options))
            last_buffer = target
            with shared.cond:
                shared.seen_version = max(shared.seen_version, have)
                shared.ready, shared.ready_version = target, have
                shared.pulled_bytes += spec.pull_bytes
                shared.cond.notify_all()
    except BaseException as err:
        with shared.cond:
            shared.error = shared.error or err
            shared.cond.notify_all()


@dataclasses.dataclass
class _Trainer:
    """The trainer thread's state from one step to the next."""
    sess: object
    inputs: RunInputs
    stats: StepStats
    shared: _Shared
    fetches: dict
    timeout_s: Optional[float]
    copy_version: int               # the global version of the local copy
    applied: int                    # global version at this rank's last step
    batch: int = 0                  # examples per step
    local_step: int = 0
    losses: List[float] = dataclasses.field(default_factory=list)


class AsyncRunner(Runner):
    """Trains with three threads sharing one session (the module's doc)."""

    def __init__(self, loss, spec: AsyncSpec, metrics=None):
        self.loss, self.spec, self.metrics = loss, spec, dict(metrics or {})   # ranks never meet: this rank's

    def train(self, sess, inputs: RunInputs, stats: StepStats) -> List[float]:
        spec, guard, steps = self.spec, inputs.guard, inputs.steps
        shared = _Shared()
        timeout_s = inputs.timeout_ms / 1000 if inputs.timeout_ms else None
        copy_version = inputs.start
        with guard("the first pull"):
            if spec.pulls:
                copy_version = int(sess.run(spec.pulls[0]))
                sess.run(spec.swaps[0])
        shared.applied_version = shared.seen_version = copy_version
        threads = _start_threads(sess, spec, shared, copy_version, inputs.timeout_ms)
        fetches = self._step_fetches(inputs)
        stats.loss_scope = "this rank"
        trainer = _Trainer(sess, inputs, stats, shared, fetches, timeout_s, copy_version, applied=copy_version)
        try:
            while True:
                with guard("taking a step ticket"):
                    if int(sess.run(spec.claim)) > steps:
                        break
                known = self._fresh_copy(trainer)
                if known is None:
                    break
                self._step(trainer, known)
            with guard("the last pushes"):
                with shared.cond:
                    _wait(shared, lambda: shared.pending == 0 or shared.error is not None, timeout_s,
                          "this rank's last pushes to be applied")
                    _raise_if_failed(shared, guard)
        finally:
            _stop_threads(sess, spec, shared, threads, timeout_s)
        with shared.cond:      # the pushes applied after this rank's last step
            stats.examples += trainer.batch * max(0, max(shared.applied_version, shared.seen_version) - trainer.applied)
        stats.extras["staleness"] = dict(sorted(shared.staleness.items()))
        stats.extras["copy_lag"] = dict(sorted(shared.copy_lag.items()))
        return trainer.losses

    def _step_fetches(self, inputs: RunInputs) -> dict:
        """What every step runs; on rank 0 also the servers' staleness histogram."""
        spec = self.spec
        fetches = {"loss": self.loss, "targets": spec.step_targets, "bytes": spec.step_bytes,
                   "metrics": self.metrics, **self.rows_fetch(inputs)}
        if inputs.ctx.rank == 0 and spec.histogram is not None:    # live, for TensorBoard (PS 0 is in this process)
            fetches["histogram"] = spec.histogram
        return fetches

    def _fresh_copy(self, trainer: _Trainer) -> Optional[int]:
        """Brings the local copy within max_staleness of the newest version this rank knows of
        (waiting for a pull, or for its own pushes when nothing is pulled) and returns that
        version; None once the pushes applied and in flight reach the steps."""
        spec, shared, guard, timeout_s = self.spec, trainer.shared, trainer.inputs.guard, trainer.timeout_s
        with shared.cond:
            _raise_if_failed(shared, guard)
            known = max(shared.applied_version, shared.seen_version) + shared.pending
            if known >= trainer.inputs.steps:
                return None
            lag_target = known - spec.max_staleness
            if shared.ready is not None and shared.ready_version < lag_target:
                shared.ready = None          # too old to be worth a swap
            if spec.pulls and trainer.copy_version < lag_target:    # bounded staleness: wait for a fresh pull
                with guard(f"waiting for the global values of version {lag_target} "
                           f"(--max_staleness={spec.max_staleness})"):
                    _wait(shared, lambda: shared.ready is not None and shared.ready_version >= lag_target,
                          timeout_s, f"a pull of version >= {lag_target}")
            elif not spec.pulls and shared.pending > spec.max_staleness:
                # nothing pulled: the step reads the servers, which must have this rank's pushes
                with guard(f"waiting for this rank's pushes (--max_staleness={spec.max_staleness})"):
                    _wait(shared, lambda: shared.pending <= spec.max_staleness, timeout_s,
                          "this rank's pushes to be applied")
            ready, ready_version = shared.ready, shared.ready_version
            if ready is not None and ready_version > trainer.copy_version:
                with guard("swapping in pulled values"):
                    trainer.sess.run(spec.swaps[ready])
                trainer.copy_version, shared.ready = ready_version, None
            fresh = trainer.copy_version if spec.pulls else known - shared.pending
            shared.copy_lag[max(0, known - fresh)] += 1
        return known

    def _step(self, trainer: _Trainer, known: int) -> None:
        """Runs one step, its update counted as pending before it can be applied, and reports it
        to the statistics and the hooks."""
        spec, shared, sess, inputs, stats = self.spec, trainer.shared, trainer.sess, trainer.inputs, trainer.stats
        ctx = inputs.ctx
        feeds = self.feeds(inputs, sess, ctx, inputs.start + trainer.local_step)
        options = tf.compat.v1.RunOptions(timeout_in_ms=inputs.timeout_ms)
        begin = time.perf_counter()
        with shared.cond:
            shared.pending += 1          # counted before it can be applied
        with inputs.guard(f"step {ctx.step}"):
            out = sess.run(trainer.fetches, feeds, options=options)
        seconds = time.perf_counter() - begin
        trainer.local_step += 1
        with shared.cond:
            moved, shared.pulled_bytes = int(out["bytes"]) + shared.pulled_bytes, 0
            # examples/s counts every rank's steps, as a synchronous run's does: the pushes
            # applied cluster-wide since this rank's last step, times its batch
            trainer.applied, counted = max(shared.applied_version, shared.seen_version), trainer.applied
        trainer.batch = self.rows_read(feeds, out)
        stats.add(seconds, {spec.route: moved}, trainer.batch * max(0, trainer.applied - counted),
                  loss=float(out["loss"]), metrics=out["metrics"])
        if "histogram" in out:
            stats.histograms["staleness"] = histogram_by_rank(out["histogram"])
        loss = float(out["loss"])
        trainer.losses.append(loss)
        self.check_finite(loss, f"rank {ctx.rank}: the loss", f" at its step {trainer.local_step}")
        done = min(known + 1, inputs.steps)
        # no rank waits for another here, so a checkpoint is rank 0's own decision
        stats.checkpoint_requested = any(hook.request(done) > 0 for hook in inputs.hooks)
        for hook in inputs.hooks:
            hook.after_step(done, loss, stats)

    def final_report(self, sess) -> dict:
        """Once every rank's pushes are in: the servers' count of pushes by rank and staleness, and
        each server task's version (all equal to the global step when every push reached every task)."""
        spec = self.spec
        histogram, versions = sess.run([spec.histogram, spec.task_versions or {}])
        return {"histograms": {"staleness": histogram_by_rank(histogram)},
                "extras": {"task_versions": {task: int(v) for task, v in sorted(versions.items())}}}


def histogram_by_rank(matrix) -> dict:
    """{rank: {staleness: pushes}} from the servers' [ranks, buckets] counts (empty cells left out)."""
    return {rank: {tau: int(n) for tau, n in enumerate(row) if n} for rank, row in enumerate(matrix)}


def _wait(shared: _Shared, condition, timeout_s, what: str) -> None:
    if not shared.cond.wait_for(lambda: condition() or shared.error is not None, timeout_s):
        raise PeerLost(f"waited {timeout_s:.0f}s for {what} (this rank: {shared.pending} push(es) not yet "
                       f"applied, the last applied at version {shared.applied_version}, the newest pull of "
                       f"version {shared.seen_version}); a server or another rank has probably stalled")


def _raise_if_failed(shared: _Shared, guard) -> None:
    if shared.error is not None:
        with guard("a background push or pull"):
            raise shared.error


def _start_threads(sess, spec: AsyncSpec, shared: _Shared, copy_version: int, timeout_ms) -> list:
    """The pusher, and the puller when the rank pulls, started."""
    threads = [threading.Thread(target=_pusher, args=(sess, spec, shared, timeout_ms), daemon=True,
                                name="parallax-pusher")]
    if spec.pulls:
        threads.append(threading.Thread(target=_puller, args=(sess, spec, shared, copy_version, timeout_ms),
                                        daemon=True, name="parallax-puller"))
    for thread in threads:
        thread.start()
    return threads


def _stop_threads(sess, spec: AsyncSpec, shared: _Shared, threads: list, timeout_s) -> None:
    """Stops the puller, closes the outbox so the pusher ends once it is empty, and joins both."""
    with shared.cond:
        shared.stop = True
        shared.cond.notify_all()
    try:
        sess.run(spec.close_outbox)
    except tf.errors.OpError:
        pass
    for thread in threads:
        thread.join(timeout_s)
