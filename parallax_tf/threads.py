"""The size of TensorFlow's thread pools: the cores this rank has, not the machine's.

TF sizes its inter-op and intra-op pools to every core the machine shows. Under a CPU quota
(a container, a cgroup per emulated host as tools.cluster makes) or with several ranks per host,
those threads take turns on fewer cores and every step pays for the hand-offs (figures in the
README, "Where a rank's CPU goes"). `--threads=auto` gives each rank its share of the cores it
may use (its cgroup's quota, else its CPU affinity), at least one; `tf` keeps TF's own sizing;
a number sets it. Where a process cannot read its quota, $PARALLAX_HOST_CPUS says it
(tools.cluster sets it: its `ip netns exec` hides /sys/fs/cgroup).

TensorFlow fixes a process's pools (and its GPUs, parallax_tf.devices) at its first server or
session, so the choice is made once per process, when the rank knows how many ranks share its
host (runtime.cluster), and travels as a ProcessConfig to every session and server it opens.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

from parallax_tf.errors import ConfigError

HOST_CPUS_ENV = "PARALLAX_HOST_CPUS"


def parse(setting: str) -> Optional[int]:
    """--threads as given: None for auto, 0 for tf, else the count; a clear error otherwise."""
    text = str(setting).strip().lower()
    if text == "auto":
        return None
    if text == "tf":
        return 0
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise ConfigError(f"--threads={setting!r}: give auto (each rank's share of its cores), tf (TensorFlow's "
                      "own sizing) or a positive number of threads per pool")


def choose(setting: str, ranks_on_host: int) -> int:
    """Threads per pool for one of `ranks_on_host` ranks (0: TF's own sizing)."""
    count = parse(setting)
    if count is not None:
        return count
    return max(1, math.floor(available_cores() / max(1, ranks_on_host)))


def available_cores() -> float:
    """The cores this process may use: its CPU affinity, capped by its cgroup's CPU quota."""
    cores = float(len(os.sched_getaffinity(0)))
    quota = float(os.environ[HOST_CPUS_ENV]) if os.environ.get(HOST_CPUS_ENV) else _cgroup_quota()
    return min(cores, quota) if quota else cores


def _cgroup_quota() -> Optional[float]:
    """Cores allowed by the `cpu` controller of this process's cgroup (v1 or v2), if it sets a quota."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):                         # v1
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                base = os.path.join("/sys/fs/cgroup", mount, path.lstrip("/"))
                quota, period = _read(base, "cpu.cfs_quota_us"), _read(base, "cpu.cfs_period_us")
                if quota is not None and period:
                    return float(quota) / float(period) if int(quota) > 0 else None   # -1: no quota
        elif controllers == "":                                      # v2
            limit = _read(os.path.join("/sys/fs/cgroup", path.lstrip("/")), "cpu.max")
            if limit and not limit.startswith("max"):
                quota, period = limit.split()[:2]
                return float(quota) / float(period)
    return None


def _read(directory: str, name: str) -> Optional[str]:
    try:
        with open(os.path.join(directory, name)) as f:
            return f.read().strip()
    except OSError:
        return None


@dataclasses.dataclass(frozen=True)
class ProcessConfig:
    """What this process's sessions and servers run with: its pools' size (0: TF's own sizing)
    and its device (a devices.DeviceChoice; None: TF's default)."""
    threads: int = 0
    device: Optional[object] = None

    def proto(self, **fields):
        """A session or server ConfigProto with these pools and device, and `fields`."""
        import tensorflow as tf
        from parallax_tf import devices
        proto = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=self.threads,
                                         intra_op_parallelism_threads=self.threads, **fields)
        devices.configure(proto, self.device)
        return proto
