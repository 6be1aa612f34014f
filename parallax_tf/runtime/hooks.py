"""What rank 0 does between steps: progress, checkpoints, TensorBoard, step traces."""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import tensorflow as tf

from parallax_tf.checkpoint import CheckpointStore
from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.plan import human_bytes
from parallax_tf.runtime import thread_cpu


class StepStats:
    def __init__(self, profile_threads_from: int = -1):
        # from this many completed steps on, CPU per thread name is counted (--profile_threads_from)
        self.profile_threads_from = profile_threads_from
        self.times: List[float] = []
        self.cpu_times: List[float] = []                # this process's CPU (all threads) per step
        self._cpu_mark = time.process_time()
        if profile_threads_from == 0:
            self._threads, self._threads_from = thread_cpu.snapshot(), 0
        self.bytes: Dict[str, List[int]] = {}           # this rank's
        self.cluster_bytes: Dict[str, List[int]] = {}   # all ranks together, from the 2nd step (a step
                                                        # report carries the step before's)
        self.lower_bound: List[int] = []
        # whether the last step counted its bytes, and its report the cluster's (--measure_every)
        self.measured = self.cluster_measured = False
        self.examples = 0
        self.losses: List[float] = []                   # the loss the progress line shows, per step
        self.metrics: Dict[str, List[float]] = {}       # Model.metrics, per step
        self.loss_scope = "mean over ranks"             # whose loss and metrics those are
        self.checkpoint_requested = False               # the last step's collective decision
        self.stop_requested = False                     # a hook ends training after this step
        self.extras: Dict[str, object] = {}             # what a strategy's own loop reports
        self.tables: Dict[str, List[int]] = {}          # rank 0: per dynamic table, [rows, admitted, evicted]
        # live per-rank histograms a strategy's loop keeps: name -> rank -> bucket -> count
        self.histograms: Dict[str, Dict[int, Dict[int, int]]] = {}

    def add(self, seconds: float, moved: Optional[Dict[str, int]], examples: int, lower_bound: Optional[int] = 0,
            cluster_moved: Optional[Dict[str, int]] = None, loss: Optional[float] = None,
            metrics: Optional[Dict[str, float]] = None) -> None:
        """One step. `moved` (this rank's bytes per route) and `lower_bound` None, `cluster_moved`
        None: not counted in that step (--measure_every)."""
        self.times.append(seconds)
        if loss is not None:
            self.losses.append(loss)
        for name, value in (metrics or {}).items():
            self.metrics.setdefault(name, []).append(float(value) if np.ndim(value) == 0 else np.asarray(value))
        now = time.process_time()
        self.cpu_times.append(now - self._cpu_mark)
        self._cpu_mark = now
        if len(self.times) == self.profile_threads_from:
            self._threads, self._threads_from = thread_cpu.snapshot(), len(self.times)
        self.examples += examples
        self.measured, self.cluster_measured = moved is not None, cluster_moved is not None
        if lower_bound is not None:
            self.lower_bound.append(int(lower_bound))
        for route, n in (moved or {}).items():
            self.bytes.setdefault(route, []).append(int(n))
        for route, n in (cluster_moved or {}).items():
            self.cluster_bytes.setdefault(route, []).append(int(n))

    def thread_cpu_per_step(self) -> Dict[str, float]:
        """CPU seconds per step by thread name since --profile_threads_from ({} when off)."""
        if not hasattr(self, "_threads") or len(self.times) <= self._threads_from:
            return {}
        steps = len(self.times) - self._threads_from
        return {name: s / steps for name, s in thread_cpu.since(self._threads).items()}

    def mean_bytes(self, cluster: bool = False) -> Dict[str, float]:
        return {route: float(np.mean(v)) for route, v in (self.cluster_bytes if cluster else self.bytes).items()}

    def recent_rate(self, window: int = 10):
        recent = self.times[-window:]
        step_s = sum(recent) / len(recent)
        per_step = self.examples / len(self.times) if self.times else 0
        return step_s, (per_step / step_s if step_s else 0.0)


@dataclasses.dataclass
class LiveRun:
    """What a hook may reach of the run it watches (Hook.attach)."""
    rank: int
    size: int
    # the trained state as single-device names -> values; collective when `reads_together`
    # (every rank must call it at the same step), else any rank may call it alone
    read_state: Callable[[], Dict[str, np.ndarray]]
    reads_together: bool
    stops_together: bool      # the ranks step together, so stats.stop_requested ends them at one step


class Hook:
    """Called by the runner around and between steps; run(hooks=[...]) adds the user's own.
    A hook may end training after a step by setting `stats.stop_requested` in after_step on
    every rank at the same step (a synchronous strategy's loop stops there)."""

    def attach(self, live: LiveRun) -> None:
        """Before begin(): the run this hook watches."""

    def begin(self, step: int) -> None:
        """Training starts at global step `step` (after initialisation, before the first step)."""

    def request(self, step: int) -> float:
        """Before step `step` (1-based) runs: > 0 to ask every rank for a checkpoint after it."""
        return 0.0

    def after_step(self, step: int, loss: float, stats: StepStats) -> None:
        """`step` is the global step just completed (1-based)."""

    def end(self, step: int) -> None:
        """Training stopped after `step` steps (also on errors)."""

    def saves_at(self, step: int) -> bool:
        """Whether it reads the training state after `step` by the step count (a pipeline drains
        there first)."""
        return False

    def final(self, step: int, histograms: Dict[str, Dict[int, Dict[int, int]]]) -> None:
        """Every rank's updates are in: the strategy's end-of-run per-rank histograms."""


class Progress(Hook):
    """A line every `every` steps; on a terminal, a bar redrawn in place between them.

    Its step time and examples/s are the wall-clock time between steps as the script waits for
    them (reading the input, the step, the hooks), over the last `window` steps; the first step
    (start-up, the graph's first run) only counts until a second one has ended."""

    def __init__(self, total: int, every: int, ranks: int = 1, stream=None, window: int = 10,
                 clock: Callable[[], float] = time.perf_counter):
        self.total, self.every, self.ranks, self.window, self.clock = total, every, ranks, window, clock
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty()
        self.previous = None   # the step of the last call (an asynchronous run's steps can jump)
        self.ended: List[tuple] = []     # (step, when it ended) of the last window's steps

    def _step_s(self, step: int, stats: StepStats) -> float:
        self.ended = (self.ended + [(step, self.clock())])[-(self.window + 1):]
        (first, began), (last, now) = self.ended[0], self.ended[-1]
        if last > first:
            return (now - began) / (last - first)
        return stats.recent_rate(1)[0]

    def after_step(self, step, loss, stats):
        step_s = self._step_s(step, stats)
        per_step = stats.examples / len(stats.times) if stats.times else 0
        rate = per_step / step_s if step_s else 0.0
        eta = (self.total - step) * step_s
        moved, whose = bytes_per_rank(stats, self.ranks)
        metrics = "".join(f" {name} {values[-1]:.4f}" for name, values in sorted(stats.metrics.items())
                          if np.ndim(values[-1]) == 0)
        line = (f"step {step}/{self.total} loss {loss:.4f}{metrics} {rate:,.0f} ex/s step {step_s * 1000:.1f}ms "
                f"eta {eta:.{1 if eta < 10 else 0}f}s bytes/step/rank{whose} "
                f"{' '.join(f'{r}={human_bytes(b)}' for r, b in sorted(moved.items()) if b) or '0'}"
                + tables_line(stats.tables))
        previous = step - 1 if self.previous is None else self.previous
        self.previous = step
        if step // self.every > previous // self.every or step == self.total:
            self.stream.write(("\r\x1b[2K" if self.live else "") + line + "\n")
        elif self.live:
            done = int(30 * step / max(1, self.total))
            self.stream.write(f"\r\x1b[2K[{'#' * done}{'.' * (30 - done)}] {line}")
        self.stream.flush()


def tables_line(tables: Dict[str, List[int]]) -> str:
    """" emb 1,234 rows (+1,300 -66)" for one dynamic table ([rows, admitted, evicted]); the
    total over several ("26 dynamic tables 22,311 rows ...")."""
    if not tables:
        return ""
    rows, admitted, evicted = (sum(t[i] for t in tables.values()) for i in range(3))
    name = next(iter(tables)) if len(tables) == 1 else f"{len(tables)} dynamic tables"
    return f" {name} {rows:,} rows (+{admitted:,} -{evicted:,})"


def bytes_per_rank(stats: StepStats, ranks: int):
    """The last counted step's bytes per route and rank, as the plan estimates them: the mean over ranks
    of the step's report; ranks that never meet (asynchronous strategies) cannot add theirs up,
    so there this rank's own, labelled so."""
    if stats.cluster_bytes:
        return {route: v[-1] / ranks for route, v in stats.cluster_bytes.items()}, ""
    return {route: v[-1] for route, v in stats.bytes.items()}, " (this rank)"


class Checkpointer(Hook):
    """Saves every `every` steps and/or `secs` seconds, and at the end of training.

    Rank 0 holds the store and writes; `step_key` names the global step among the state's
    values. When reading the state is collective, every rank has a Checkpointer (store None) and
    reads at the same steps: by step count, or when rank 0's clock asked for one through the
    step's collective report."""

    def __init__(self, store: Optional[CheckpointStore], read_state, every: int, secs: float,
                 at_end: bool = True, step_key: Optional[str] = None):
        self.store, self.read_state, self.step_key = store, read_state, step_key
        self.every, self.secs, self.at_end = every, secs, at_end
        self.last_time = time.monotonic()
        self.last_step: Optional[int] = None
        self.last_path: Optional[str] = store.latest() if store else None
        self.seconds: List[float] = []      # per save: reading the state and writing it
        self.bytes = 0                      # of the last save's values

    def request(self, step):
        return 1.0 if self.store and self.secs and time.monotonic() - self.last_time >= self.secs else 0.0

    def after_step(self, step, loss, stats):
        # a multiple of `every` crossed (an asynchronous run's steps can jump)
        previous = self.last_step if self.last_step is not None else step - 1
        if (self.every and step // self.every > previous // self.every) or stats.checkpoint_requested:
            self.save(step)

    def saves_at(self, step):
        return bool(self.every) and step % self.every == 0

    def save(self, step: int) -> None:
        if step == self.last_step:
            return
        began = time.perf_counter()
        values = self.read_state()
        if self.store is not None:
            # named by the global step it holds: an asynchronous run's step moves on while it is read
            saved = int(values[self.step_key]) if self.step_key in values else step
            self.last_path = self.store.save(values, saved)
            self.bytes = sum(np.asarray(v).nbytes for v in values.values())
        self.seconds.append(time.perf_counter() - began)
        self.last_step, self.last_time = step, time.monotonic()

    def end(self, step):
        if self.at_end:
            self.save(step)


class Summaries(Hook):
    """TensorBoard event files: loss, examples/s, step time and bytes per route.

    Written as Summary protos by TF1's FileWriter: eager tf.summary ops crash (SIGSEGV) in a
    process that also serves a tf.distribute.Server, and none are needed to write events."""

    def __init__(self, logdir: str):
        with tf.Graph().as_default():     # FileWriter refuses to be built in eager mode
            self.writer = tf.compat.v1.summary.FileWriter(logdir)

    def after_step(self, step, loss, stats):
        step_s, rate = stats.recent_rate(window=1)
        values = {"loss": loss, "examples_per_second": rate, "step_seconds": step_s}
        values.update({f"metrics/{name}": v[-1] for name, v in stats.metrics.items() if np.ndim(v[-1]) == 0})
        if stats.measured:
            values.update({f"bytes_per_step/{route}": v[-1] for route, v in stats.bytes.items()})
        if stats.cluster_measured:
            values.update({f"cluster_bytes_per_step/{route}": v[-1] for route, v in stats.cluster_bytes.items()})
        summary = tf.compat.v1.Summary(value=[tf.compat.v1.Summary.Value(tag=tag, simple_value=float(v))
                                              for tag, v in values.items()])
        self._add_histograms(summary, stats.histograms)
        self.writer.add_summary(summary, step)

    def end(self, step):
        self.writer.flush()

    def final(self, step, histograms):
        if histograms:
            summary = tf.compat.v1.Summary()
            self._add_histograms(summary, histograms)
            self.writer.add_summary(summary, step)
            self.writer.flush()

    @staticmethod
    def _add_histograms(summary, histograms) -> None:
        for name, by_rank in histograms.items():
            summary.value.extend(tf.compat.v1.Summary.Value(tag=f"{name}/rank{rank}", histo=histogram_proto(counts))
                                 for rank, counts in sorted(by_rank.items()) if counts)


def histogram_proto(counts: Dict[int, int]):
    """A TensorBoard histogram of integer values from {value: count}: one bucket per value."""
    values = sorted(counts)
    total = sum(counts.values())
    return tf.compat.v1.HistogramProto(
        min=float(values[0]), max=float(values[-1]), num=float(total),
        sum=float(sum(v * n for v, n in counts.items())), sum_squares=float(sum(v * v * n for v, n in counts.items())),
        bucket_limit=[v + 0.5 for v in values], bucket=[float(counts[v]) for v in values])


def format_histogram(counts: Dict[int, int], limit: int = 12) -> str:
    """'0:8 1:85 2:66 ... (mean 1.9, max 6, n 219)': the `limit` most common values in order."""
    total = sum(counts.values())
    if not total:
        return "none"
    shown = sorted(sorted(counts, key=lambda v: -counts[v])[:limit])
    mean = sum(v * n for v, n in counts.items()) / total
    return " ".join(f"{v}:{counts[v]}" for v in shown) + ("" if len(shown) == len(counts) else " ...") + \
        f" (mean {mean:.1f}, max {max(counts)}, n {total})"


class StepTracer:
    """Full TF traces of chosen steps, written as one Chrome trace (chrome://tracing, Perfetto)."""

    def __init__(self, path: Optional[str], steps):
        self.path, self.steps = path, set(steps)
        self.events: list = []

    def options(self, step: int):
        if not self.path or step not in self.steps:
            return None, None
        return (tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
                tf.compat.v1.RunMetadata())

    def record(self, step: int, metadata) -> None:
        if metadata is None:
            return
        trace = json.loads(tf_shim.chrome_trace(metadata.step_stats))
        for event in trace["traceEvents"]:
            event.setdefault("args", {})["step"] = step
        self.events.extend(trace["traceEvents"])

    def write(self) -> None:
        if self.path and self.events:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "w") as out:
                json.dump({"traceEvents": self.events}, out)
