"""Opening a rank's session, initialising it in order, and naming a lost peer in errors."""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

import tensorflow as tf

from parallax_tf.errors import ClusterError
from parallax_tf import threads as pool_threads
from parallax_tf.runtime import placement, rank_objects


def remote_tasks(graph, rank: int) -> List[str]:
    """The tasks besides this rank's worker that the graph places ops on (the workers hosting
    PS state, a pipeline stage's queue on its neighbour)."""
    found = set()
    for op in graph.get_operations():
        spec = tf.DeviceSpec.from_string(op.device) if op.device else None
        if spec is None or spec.job is None or (spec.job == "worker" and spec.task in (None, rank)):
            continue
        found.add(f"/job:{spec.job}/task:{spec.task or 0}")
    return sorted(found)


def alone(remote: List[str], rank: int, size: int) -> bool:
    """Whether this rank's graph runs in its own process only and no other rank's graph runs
    anything on its worker (collective: every rank calls it once, before its session)."""
    everyone = [remote]
    if size > 1:
        everyone = rank_objects.allgather(remote)
    return not remote and not any(f"/job:worker/task:{rank}" in other for other in everyone)


def open_session(target: str, graph, rank: int, timeout_s: int, remote: List[str], in_process: bool = False,
                 process: pool_threads.ProcessConfig = pool_threads.ProcessConfig()):
    """`in_process` (see alone()): a direct session of this process, not one through the gRPC
    master. (lm, 2 hosts, 1 Gbit: Horovod's own baseline run through its server's target takes
    9.5-10.3 ms a step instead of 6.7-7.7.) Its devices are the process's own, so the graph's
    placements on this rank's worker are dropped first."""
    # Soft placement settles what TF's own gradient code colocates with a PS variable while we
    # asked for the worker (zeros for a variable read inside a while loop), as TF1's
    # MonitoredTrainingSession does; every op is still placed explicitly by the rewriter.
    config = process.proto(allow_soft_placement=True, operation_timeout_in_ms=timeout_s * 1000)
    if in_process:
        placement.drop_placements(graph)
        return tf.compat.v1.Session("", graph=graph, config=config)
    # Only this rank's worker and the tasks its graph uses (`remote`): a session must not wait
    # for other workers.
    config.device_filters.extend([f"/job:worker/task:{rank}"] + list(remote))
    return tf.compat.v1.Session(target, graph=graph, config=config)


class PeerLost(ClusterError):
    """A peer rank died or stalled; cleanup that needs the peers must be skipped."""


def stall_bound_s(timeout_s: int) -> int:
    """How long a step or barrier may run before the watchdog stops the rank: TF's deadline and
    Horovod's stall shutdown (each --timeout_s) come first, as they name the cause better, with a
    margin for a busy machine of up to 30 s."""
    return 2 * timeout_s + min(30, 2 * timeout_s)


@contextlib.contextmanager
def cross_rank_errors(what: str, timeout_s: int, rank: int = 0, lost: Optional[Callable[[], str]] = None,
                      deadline: Optional[Callable] = None):
    """Turns the ways a dead or stalled peer shows up into one error naming the wait and, when
    `lost` can tell, the ranks that are gone. `deadline(what, seconds)` (the watchdog's) stops
    the rank when the wait outlives stall_bound_s, which TF alone cannot ensure."""
    def fail(why: str):
        found = lost() if lost else ""
        gone = f"; lost: {found}" if found else ""
        return PeerLost(f"parallax_tf rank {rank}: {what}: {why}{gone}")
    bounded = deadline(what, stall_bound_s(timeout_s)) if deadline and timeout_s else contextlib.nullcontext()
    try:
        with bounded:
            yield
    except tf.errors.DeadlineExceededError as err:
        raise fail(f"no answer within --timeout_s={timeout_s}s while running {_op_name(err)}; another "
                   "rank has probably died or stalled") from None
    except tf.errors.UnavailableError as err:
        raise fail(f"a server became unreachable ({_first_line(err)})") from None
    except tf.errors.OpError as err:
        if "orovod" in err.message or "gloo" in err.message.lower():
            raise fail(f"Horovod stopped ({_first_line(err)})") from None
        # any other failure while a peer no longer answers is that peer's loss
        if lost and lost():
            raise fail(f"{type(err).__name__} ({_first_line(err)})") from None
        raise


def initialise(sess, dgraph, state_io, values, is_chief: bool, guard, input_reads=()) -> int:
    """PS state once (rank 0), replicas everywhere, then broadcast from rank 0 behind a barrier.
    `values` (rank 0: initial values or a checkpoint) overwrite what initialisers produced.
    `input_reads`: the tf.data iterator reads of a step, run once per step already trained on a
    resume. Returns the global step training starts at."""
    with guard("initialisation"):
        sess.run(dgraph.local_init)
        if is_chief:
            sess.run(dgraph.chief_init)
            state_io.load(sess, values)
        state_io.scatter(sess, values if is_chief else None)    # what the ranks themselves hold
        dgraph.barrier.wait(sess, "initialised")     # nobody trains before PS variables are initialised
        if dgraph.broadcast is not None:
            sess.run(dgraph.broadcast)                # replicas, a replicated global step among them
        start = int(sess.run(dgraph.global_step))
        for _ in range(start if input_reads else 0):   # tf.data input continues where the resumed run stopped
            sess.run(input_reads)
        # every rank has read the starting step before any trains: an asynchronous rank 0 would
        # otherwise push its first step while a slower rank still reads, which then starts at 1
        dgraph.barrier.wait(sess, "started")
        return start


def _op_name(err) -> str:
    return err.op.name if getattr(err, "op", None) is not None else "a blocking op"


def _first_line(err) -> str:
    """The cause's line of a TF error message: TF 2 puts "Graph execution error:" and where the op
    was defined first, then "Node: 'name'" and the cause."""
    lines = [line.strip() for line in (err.message or "").splitlines() if line.strip()]
    for index, line in enumerate(lines[:-1]):
        if line.startswith("Node: "):
            return lines[index + 1][:200]
    lines = [line for line in lines if line != "Graph execution error:" and not line.startswith("[[")]
    return lines[0][:200] if lines else type(err).__name__
