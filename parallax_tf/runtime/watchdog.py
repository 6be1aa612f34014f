"""Notices a lost peer and stops this rank with a message naming it, instead of hanging.

Two ways a rank learns a peer is gone: the peer's gRPC server stops accepting connections
(probed every `interval` seconds), or the launcher sends SIGTERM after a rank died. A rank
blocked inside session.run cannot run a Python signal handler, so the signal is routed to a
wakeup pipe that this thread watches.

Peers in `expendable` (ranks the job can go on without) are only noted when they stop
answering: they drop out of `alive()` and this rank goes on.

A third way out: the launcher's rendezvous server (`launcher`) stops answering. A rank started
through ssh would otherwise outlive a launcher that is killed or stopped (the ssh client goes,
the rank does not); a rank on the launcher's own host learns it sooner, from its line to the
launcher (lifeline.py).

A fourth way out: a wait under `deadline()` that outlives it. TF cancels a step at its timeout,
but a Horovod collective ignores the cancellation, so ranks waiting in different collectives
(each answering the probes) would otherwise wait forever."""
from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Dict, Iterable, Optional, Set

from parallax_tf.runtime.lifeline import LAUNCHER_GONE_STATUS as LAUNCHER_GONE_EXIT

LOST_RANK_EXIT = 75     # launcher.PEER_LOST_STATUS: the launcher blames the lost peer, not this rank
STALLED_EXIT = 76


def launcher_address() -> Optional[str]:
    """host:port of the gloo rendezvous server of the launcher that started this rank, if any."""
    host, port = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"), os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    return f"{host}:{port}" if host and port else None


class Watchdog:
    def __init__(self, rank: int, peers: Dict[int, str], interval: float = 1.0, misses: int = 2,
                 expendable: Iterable[int] = (), launcher: Optional[str] = None):
        self.rank, self.interval, self.misses = rank, interval, misses
        self.launcher = launcher
        self.peers = {r: a for r, a in peers.items() if r != rank}
        self.everyone = set(peers) | {rank}
        self.expendable = set(expendable) - {rank}
        self.gone: Dict[int, str] = {}      # expendable peers that stopped answering
        self._stop = threading.Event()
        self._thread = None
        self._wake_r = self._wake_w = None
        self._old = None
        self._deadlines: Dict[object, tuple] = {}    # open waits: token -> (monotonic end, what, seconds)

    def start(self) -> "Watchdog":
        if threading.current_thread() is threading.main_thread():
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_w, False)
            self._old = (signal.signal(signal.SIGTERM, lambda *_: None), signal.set_wakeup_fd(self._wake_w))
        self._thread = threading.Thread(target=self._watch, name="parallax-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._old is not None:      # its pipe is open: end the thread's select now, not after `interval`
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:       # the pipe is full: the select is awake anyway
                pass
        if self._thread:
            self._thread.join(timeout=self.interval + 2)
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old[0])
            signal.set_wakeup_fd(self._old[1])
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._old = None

    @contextlib.contextmanager
    def deadline(self, what: str, seconds: float):
        """Stops this rank if the block has not finished `seconds` from now."""
        token = object()
        self._deadlines[token] = (time.monotonic() + seconds, what, seconds)
        try:
            yield
        finally:
            del self._deadlines[token]

    def alive(self) -> Set[int]:
        """The ranks not known to be gone (this one included)."""
        return self.everyone - set(self.gone)

    def _watch(self) -> None:
        missed, strikes, launcher_missed = 0, {}, 0
        while not self._stop.is_set():
            if self._wake_r is not None:
                ready, _, _ = select.select([self._wake_r], [], [], self.interval)
                if ready and not self._stop.is_set():
                    self._die("the launcher is stopping the job (SIGTERM)", 128 + signal.SIGTERM)
            else:
                self._stop.wait(self.interval)
            if self._stop.is_set():
                return
            overdue = [d for d in list(self._deadlines.values()) if time.monotonic() > d[0]]
            if overdue:
                _, what, seconds = overdue[0]
                self._die(f"{what} has not finished after {seconds:.0f}s (TF's timeout cannot interrupt a "
                          "Horovod collective: the ranks are probably waiting in different ones)", STALLED_EXIT)
            if self.launcher:
                launcher_missed = 0 if _answers(self.launcher, self.interval) else launcher_missed + 1
                if launcher_missed > self.misses:
                    sys.stderr.write(f"parallax_tf rank {self.rank}: the launcher that started this rank "
                                     f"({self.launcher}) is gone; stopping this rank\n")
                    sys.stderr.flush()
                    os._exit(LAUNCHER_GONE_EXIT)
            unreachable = self._unreachable()
            for rank in self.expendable - set(self.gone):
                strikes[rank] = strikes.get(rank, 0) + 1 if rank in unreachable else 0
                if strikes[rank] >= self.misses:
                    self._note_gone(rank, unreachable[rank])
            missed = missed + 1 if set(unreachable) - self.expendable else 0
            if missed >= self.misses:
                self._die("a peer stopped answering", LOST_RANK_EXIT)

    def _note_gone(self, rank: int, address: str) -> None:
        self.gone[rank] = address
        del self.peers[rank]
        sys.stderr.write(f"parallax_tf rank {self.rank}: rank {rank} ({address}) stopped answering; it holds no "
                         "server state, so this rank goes on without it\n")
        sys.stderr.flush()

    def _unreachable(self) -> Dict[int, str]:
        return {rank: address for rank, address in list(self.peers.items()) if not _answers(address, self.interval)}

    def lost(self) -> str:
        """The peers that no longer answer, as 'rank 2 (host:port)' ("" for none), for error messages. A peer
        killed a moment ago may still accept connections briefly, so look again before saying
        none is gone."""
        gone = self._unreachable()
        for _ in range(4):
            if gone:
                break
            time.sleep(0.5)
            gone = self._unreachable()
        gone.update(self.gone)
        return ", ".join(f"rank {r} ({a})" for r, a in sorted(gone.items()))

    def _die(self, why: str, code: int) -> None:
        lost = self.lost()
        sys.stderr.write(f"parallax_tf rank {self.rank}: {why}{'; lost: ' + lost if lost else ''}. Stopping this "
                         "rank; restart the job to resume from the last checkpoint\n")
        sys.stderr.flush()
        os._exit(code)


def _answers(address: str, interval: float) -> bool:
    """Whether something accepts TCP connections at host:port."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=min(2.0, interval * 2)):
            return True
    except OSError:
        return False
