"""Bytes and frames an emulated host's link carried over a run (tools/cluster.py sets
PARALLAX_LINK_IFACE for the first rank of each host, whose network namespace is the host's)."""
from __future__ import annotations

import os
from typing import Optional

from parallax_tf.runtime.hooks import Hook


def read() -> Optional[dict]:
    """tx/rx bytes and frames of this host's link and its TCP retransmissions, or None where the
    run is not on an emulated host."""
    iface = os.environ.get("PARALLAX_LINK_IFACE")
    if not iface:
        return None

    def statistic(name: str) -> int:
        with open(f"/sys/class/net/{iface}/statistics/{name}") as f:
            return int(f.read())
    counters = {k: statistic(f"{k}_bytes") for k in ("tx", "rx")}
    counters.update({f"{k}_packets": statistic(f"{k}_packets") for k in ("tx", "rx")})
    counters.update(_tcp_segments())
    return counters


def _tcp_segments() -> dict:
    """This network namespace's retransmitted TCP segments (/proc/net/snmp)."""
    try:
        with open("/proc/net/snmp") as f:
            names, values = [line.split()[1:] for line in f if line.startswith("Tcp:")][:2]
    except (OSError, ValueError):
        return {}
    row = dict(zip(names, values))
    return {"tcp_retrans_segs": int(row["RetransSegs"])}


def difference(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    return {k: after[k] - before[k] for k in after} if before and after else None


class LinkCounter(Hook):
    """A run() hook: the link's counters over the training loop (`moved`, None off an emulated
    host or on a host's other ranks)."""

    def __init__(self, local_rank: int):
        self.counts = local_rank == 0
        self.before = self.moved = None

    def begin(self, step: int) -> None:
        self.before = read() if self.counts else None

    def end(self, step: int) -> None:
        self.moved = difference(self.before, read() if self.before else None)
