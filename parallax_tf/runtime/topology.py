"""Who runs where: the job's ranks, their hosts, and which rank serves each host's PS state."""
from __future__ import annotations

import dataclasses
from typing import List


@dataclasses.dataclass
class Topology:
    """Who runs where, as the rewriter needs it (plain data; the runtime fills it)."""
    rank: int
    size: int
    local_rank: int
    local_size: int
    host: int                  # index of this rank's host = index of the PS task on it
    ranks_per_host: List[int]  # number of ranks on each host
    device_type: str = "CPU"   # what every rank computes on: "GPU" (its own one) or "CPU" (parallax_tf.devices)

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def worker_device(self) -> str:
        return f"/job:worker/task:{self.rank}"

    @property
    def server_ranks(self) -> List[int]:
        """The ranks whose server holds their host's PS state: the first rank of each host."""
        firsts, start = [], 0
        for count in self.ranks_per_host:
            firsts.append(start)
            start += count
        return firsts

    def crosses_processes(self, ps_device) -> bool:
        """Whether reaching a PS device (`/job:ps/task:<host>/...`) leaves this rank's process:
        the first rank of each host serves that host's PS state in its own process. No device:
        nothing to reach."""
        if ps_device is None:
            return False
        import tensorflow as tf
        return not (tf.DeviceSpec.from_string(ps_device).task == self.host and self.local_rank == 0)

    def host_of(self, rank: int) -> int:
        start = 0
        for host, count in enumerate(self.ranks_per_host):
            start += count
            if rank < start:
                return host
        raise ValueError(f"rank {rank} is on no host of {self.ranks_per_host}")
