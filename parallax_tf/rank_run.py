"""What one rank's training passes between the steps of parallax_tf.api's run (its rewritten
graph, its session and hooks, what the steps returned) and the Result made from them; and
which rank of which job this process is (`ptf.rank()`, `ptf.size()`)."""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from parallax_tf.checkpoint import CheckpointStore
from parallax_tf.model import Result
from parallax_tf.runtime.hooks import Checkpointer, StepTracer
from parallax_tf.runtime.watchdog import Watchdog
from parallax_tf.values import StateIO


# what each launcher tells a rank: horovodrun and parallax_tf's launcher, Open MPI's mpirun, MPICH
LAUNCHER_ENV = (("HOROVOD_RANK", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                ("PMI_RANK", "PMI_SIZE"))


def rank() -> int:
    """This process's rank in the job: Horovod's, once run or fit has started the job here;
    before that the launcher's (its environment); 0 in a process no launcher started."""
    return _rank_and_size()[0]


def size() -> int:
    """The job's number of ranks, as `rank()` finds it (1 in a process no launcher started)."""
    return _rank_and_size()[1]


def _rank_and_size():
    hvd = sys.modules.get("horovod.tensorflow")
    if hvd is not None and hvd.is_initialized():
        return hvd.rank(), hvd.size()
    for rank_name, size_name in LAUNCHER_ENV:
        if os.environ.get(rank_name, "").isdigit() and os.environ.get(size_name, "").isdigit():
            return int(os.environ[rank_name]), int(os.environ[size_name])
    return 0, 1


@dataclasses.dataclass
class RankGraph:
    """One rank's rewritten graph, finalized, and what reads and writes its state."""
    graph: tf.Graph
    dgraph: object
    state_io: StateIO
    input_reads: list
    batch_rows: object
    on_cpu_instead: Optional[dict]


@dataclasses.dataclass
class RankSession:
    """The session on a rank's graph and what runs around its steps."""
    sess: object
    store: Optional[CheckpointStore]
    commits: Optional[CheckpointStore]
    start_values: dict
    hooks: list
    checkpointer: Optional[Checkpointer]
    committer: Optional[Checkpointer]
    results: list               # the keys of the variables read back at the end
    tracer: StepTracer
    watchdog: Optional[Watchdog]
    alive: Callable
    guard: Callable
    read: bool = False          # every rank has read the results: the servers may be reset


@dataclasses.dataclass
class Trained:
    """What the steps of one rank returned and the state read back after them."""
    start: int
    losses: list
    stats: object
    wall: float
    cpu: float
    variables: dict
    global_step: int
    histograms: dict


def result(plan, topo, phases: dict, built: RankGraph, ran: RankSession, trained: Trained) -> Result:
    """The Result of this rank: the state read back, the losses and the step statistics."""
    stats, wall = trained.stats, trained.wall
    stats.extras["phases"] = phases
    if built.on_cpu_instead is not None:
        stats.extras["ops_without_gpu_kernel"] = built.on_cpu_instead
    for name, saver in (("checkpoint", ran.checkpointer), ("commit", ran.committer)):
        if saver is not None and saver.store is not None and saver.seconds:
            stats.extras[f"{name}_ms"] = [round(s * 1000, 2) for s in saver.seconds]
            stats.extras[f"{name}_bytes"] = saver.bytes
    ended = [t.name for t in plan.dynamic_tables or () if f"{t.name}/clock" in trained.variables]
    if ended:       # each dynamic table at the end: rows, and rows admitted and evicted since it began
        stats.extras["dynamic_tables"] = {name: {"rows": int(len(trained.variables[f"{name}/ids"])),
                                                 "admitted": int(trained.variables[f"{name}/clock"][1]),
                                                 "evicted": int(trained.variables[f"{name}/clock"][2])}
                                          for name in ended}
    return Result(variables=trained.variables, losses=trained.losses, plan=plan, global_step=trained.global_step,
                  start_step=trained.start,
                  wall_time_s=wall, examples_per_s=(stats.examples / wall if wall and stats.examples else None),
                  bytes_per_step=stats.mean_bytes(), cluster_bytes_per_step=stats.mean_bytes(cluster=True),
                  step_times=stats.times,
                  examples_per_step=stats.examples // max(1, len(stats.times)),
                  cpu_s_per_step=trained.cpu / max(1, len(stats.times)), step_cpu_s=stats.cpu_times,
                  lower_bound_bytes_per_step=float(np.mean(stats.lower_bound)) if stats.lower_bound else 0.0,
                  checkpoint=ran.checkpointer.last_path if ran.checkpointer else None, extras=stats.extras,
                  histograms=trained.histograms, lost_ranks=sorted(set(range(topo.size)) - ran.alive()),
                  metrics=stats.metrics, mean_losses=stats.losses, rank=topo.rank, size=topo.size)
