"""The cluster a plan is priced on: its hosts, ranks, links and the calibrated per-message and
CPU constants (tools.calibrate's, else calibration.Calibration's defaults), and the link flags'
units (--link_bandwidth, --link_delay)."""
from __future__ import annotations

import dataclasses
import re
from typing import Optional

from parallax_tf.calibration import Calibration, load as load_calibration

_DEFAULTS = Calibration()
# what a switch port queues, in seconds of its link's rate: tools.netns's emulated links queue
# this much (its QUEUE_S); a real switch's buffer is its own figure
PORT_QUEUE_S = 0.2


@dataclasses.dataclass
class Cluster:
    hosts: int
    ranks_per_host: int = 1
    bandwidth_bytes_per_s: float = 100e6 / 8
    delay_s: float = 0.0                 # one way, per link
    # what a port queues before it drops, in seconds of its link's rate (the rig's tbf queues)
    port_queue_s: float = PORT_QUEUE_S
    message_overhead_s: float = _DEFAULTS.message_overhead_s   # what a server spends per RPC it handles
    rpc_overhead_s: float = _DEFAULTS.rpc_overhead_s           # fixed cost of one PS round trip on a worker
    cores: Optional[int] = None          # CPUs all ranks share (emulation); None: one host each
    memory_bytes: Optional[float] = None  # one host's memory (None: not known)
    # CPU one rank spends per step besides its compute (host_cpu_terms says what each multiplies):
    # a step takes at least the busiest host's, times ranks / cores when ranks share cores. All
    # these constants come from tools.calibrate.
    runtime_cpu_s: float = _DEFAULTS.runtime_cpu_s
    task_cpu_s: float = _DEFAULTS.task_cpu_s
    peer_cpu_s: float = _DEFAULTS.peer_cpu_s
    master_cpu_s: float = _DEFAULTS.master_cpu_s
    serve_cpu_s: float = _DEFAULTS.serve_cpu_s
    received_cpu_s_per_byte: float = _DEFAULTS.received_cpu_s_per_byte
    ring_cpu_s_per_byte: float = _DEFAULTS.ring_cpu_s_per_byte
    replica_cpu_s_per_byte: float = _DEFAULTS.replica_cpu_s_per_byte
    exchange_cpu_s: float = _DEFAULTS.exchange_cpu_s
    exchange_table_cpu_s: float = _DEFAULTS.exchange_table_cpu_s
    calibration: str = _DEFAULTS.source

    @classmethod
    def calibrated(cls, hosts: int, ranks_per_host: int, bandwidth_bytes_per_s: float, delay_s: float = 0.0,
                   cores: Optional[int] = None, calibration: Optional[Calibration] = None,
                   memory_bytes: Optional[float] = None) -> "Cluster":
        calibration = calibration or load_calibration()
        return cls(hosts, ranks_per_host, bandwidth_bytes_per_s, delay_s, cores=cores, memory_bytes=memory_bytes,
                   calibration=calibration.source, **calibration.constants())

    @property
    def ranks(self) -> int:
        return self.hosts * self.ranks_per_host

    @property
    def runtime_cpu(self) -> float:
        """A rank's CPU per step besides compute, PS tasks and the bytes it receives."""
        return self.runtime_cpu_s + self.peer_cpu_s * (self.ranks - 1)

    @property
    def cpu_turns(self) -> float:
        """How much longer a rank's CPU work takes when ranks share fewer cores (emulation: each
        host gets cores / hosts, as the rig's quotas give)."""
        return max(1.0, self.ranks / self.cores) if self.cores else 1.0


def parse_rate(rate: str) -> float:
    """tc-style rate ('100mbit', '1gbit', '12500kbps') in bytes per second."""
    match = re.fullmatch(r"([0-9.]+)\s*([kmg]?)(bit|bps)", rate.strip().lower())
    if not match:
        raise ValueError(f"cannot read rate {rate!r}; write it like 100mbit or 1gbit")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
    value = float(match.group(1)) * scale
    return value / 8 if match.group(3) == "bit" else value


def parse_delay(delay: str) -> float:
    match = re.fullmatch(r"([0-9.]+)\s*(us|ms|s)?", delay.strip().lower())
    if not match:
        raise ValueError(f"cannot read delay {delay!r}; write it like 1ms")
    return float(match.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1e-3}[match.group(2)]
