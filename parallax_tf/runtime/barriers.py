"""Cross-rank rendezvous points of a run: after initialisation ("initialised"), after training
("trained": every update is in, results may be read) and after reading ("read": no rank stops
its servers while others still read from them). A rewriter builds one kind into its graph; the
runtime calls `wait(sess, purpose, alive, timeout_s)` at each point."""
from __future__ import annotations

import time
from typing import Callable, Set

import tensorflow as tf

from parallax_tf.errors import ClusterError

POLL_S = 0.02


class CollectiveBarrier:
    """A Horovod allreduce every rank runs: it returns once all ranks have arrived."""

    def __init__(self, name: str = "parallax_barrier"):
        import horovod.tensorflow as hvd
        # The input must not be a constant: grappler would fold the allreduce on the first run and
        # every later run of the cached graph would pass without waiting for anyone.
        self.op = hvd.allreduce(tf.random.uniform([]), op=hvd.Sum, name=name).op
        self.init_ops = []

    def wait(self, sess, purpose: str, alive: Callable[[], Set[int]] = None, timeout_s: float = 0) -> None:
        sess.run(self.op)

    def may_reset(self, rank: int) -> bool:
        """Whether `rank` may free the run's variables on every server of the job after "read":
        with a collective barrier every rank leaves at once, all servers still up."""
        return True


class ArrivalBarrier(CollectiveBarrier):
    """For jobs that go on without a lost rank: after initialisation (when every rank is still
    needed) it is collective; later each rank sets its flag in a vector on PS task 0 and waits
    until every rank still alive has set its own. Horovod cannot do that: its collectives need
    every rank, and a lost one stops them for good.

    At "read" a rank that runs no server leaves as soon as it has arrived; a server rank stays
    until every rank still alive has read, then says it is leaving ("left"), and rank 0, whose
    server holds the flags, leaves last."""

    def __init__(self, rank: int, size: int, server_ranks):
        super().__init__()
        self.rank, self.size, self.server_ranks = rank, size, set(server_ranks)
        self.arrive, self.flags = {}, {}
        with tf.device("/job:ps/task:0"), tf.compat.v1.colocate_with(None, ignore_existing=True):
            for purpose in ("trained", "read", "left"):
                # in no collection: not model state, initialised by rank 0 only (init_ops)
                flags = tf.compat.v1.Variable(tf.zeros([size], tf.int32), trainable=False, use_resource=True,
                                              collections=[], name=f"parallax_arrivals/{purpose}")
                self.arrive[purpose] = flags.scatter_update(
                    tf.IndexedSlices(tf.ones([1], tf.int32), tf.constant([rank]))).op
                self.flags[purpose] = flags.read_value()
                self.init_ops.append(flags.initializer)

    def wait(self, sess, purpose: str, alive: Callable[[], Set[int]] = None, timeout_s: float = 0) -> None:
        if purpose not in self.arrive:
            return super().wait(sess, purpose)
        alive = alive or (lambda: set(range(self.size)))
        sess.run(self.arrive[purpose])
        if purpose == "read" and self.rank not in self.server_ranks:
            return
        self._await(sess, purpose, alive, timeout_s)
        if purpose == "read" and self.rank != 0:
            sess.run(self.arrive["left"])
        elif purpose == "read":
            self._await(sess, "left", lambda: alive() & (self.server_ranks - {0}), timeout_s)

    def may_reset(self, rank: int) -> bool:
        # Ranks leave one by one here, and TF's reset reaches every worker of the cluster: it
        # would wait forever for one that already left. The run's variables stay in its
        # servers' memory until the process exits.
        return False

    def _await(self, sess, purpose: str, expected: Callable[[], Set[int]], timeout_s: float) -> None:
        deadline = time.monotonic() + (timeout_s or float("inf"))
        while True:
            arrived = {r for r, flag in enumerate(sess.run(self.flags[purpose])) if flag}
            missing = sorted(expected() - arrived)
            if not missing:
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"waited {timeout_s:.0f}s at the '{purpose}' barrier for rank(s) {missing}, which "
                                   "still answer but never arrived; they have probably stalled")
            time.sleep(POLL_S)
