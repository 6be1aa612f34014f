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

    def host_of(self, rank: int) -> int:
        start = 0
        for host, count in enumerate(self.ranks_per_host):
            start += count
            if rank < start:
                return host
        raise ValueError(f"rank {rank} is on no host of {self.ranks_per_host}")
