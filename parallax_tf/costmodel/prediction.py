"""A plan's predicted step on a cluster.

How the parts add up: the busiest link sets the network time, for collectives and for PS
traffic apart; round trips add latency; each graph run a server handles costs a fixed overhead;
compute is the measured single-device CPU time; a step takes at least the CPU of the busiest
host's rank (cpu.py), stretched when more ranks than cores share a machine (as on an emulated
cluster). PS transfers are each rank's own and overlap with its CPU work (and with other
ranks'), so they sit inside max(CPU bound, compute + PS network + server). A collective is a
barrier: every rank waits for it with nothing left to compute, so its link time adds to the
step, as round trips do (a CPU-bound rank still waits them out). On 39 runs of the rig's sweep
(1 Gbit and 100 Mbit, lm and cnn, 2-8 hosts) this cut the mean error from 22% (all overlapped)
to 14%."""
from __future__ import annotations

import dataclasses
from typing import Dict, List

from parallax_tf.costmodel.cluster import Cluster
from parallax_tf.costmodel.cpu import cpu_s, host_cpu_terms
from parallax_tf.costmodel.traffic import (EXCHANGE, GATHER, POINT, RING, Choice, Load, runs_through_master,
                                           traffic_by_kind)
from parallax_tf.plan import ROUTE_ALLREDUCE, ROUTE_ALLTOALL


@dataclasses.dataclass
class Prediction:
    compute_s: float
    network_s: float              # point-to-point (PS) transfers on the busiest link
    latency_s: float
    server_s: float
    cpu_bound_s: float = 0.0      # a rank's CPU work, on its share of the cores
    collective_s: float = 0.0     # AllReduce, allgather and alltoall on the busiest link
    exchange_cpu_s: float = 0.0   # of cpu_bound_s: the alltoall route's own, spent while its exchanges run

    @property
    def step_s(self) -> float:
        # Collectives and round trips are waited out by every rank with its CPU (its host's
        # share of the cores, on the rig) idle: they add to both bounds (see the module doc).
        # The alltoall route's own CPU is the exception: Horovod's and gloo's threads spend it
        # while the exchanges hold the links (recsys, 8 hosts, 10 Mbit: 15.4 ms of CPU per rank
        # on a quarter of a core, 88 ms of frames on each link, a step of 89.9 ms)
        hidden = min(self.exchange_cpu_s, self.collective_s)
        return max(self.compute_s + self.network_s + self.server_s, self.cpu_bound_s - hidden) + self.collective_s \
            + self.latency_s


def predict(loads: List[Load], choices: Dict[str, Choice], cluster: Cluster, compute_s: float) -> Prediction:
    H, N = cluster.hosts, cluster.ranks
    flows = traffic_by_kind(loads, choices, cluster)
    traffic, messages, _ = flows
    has_ps = runs_through_master(loads, choices)
    has_ar = any(choices[l.name].route == ROUTE_ALLREDUCE and l.gradient == "dense" for l in loads)
    has_allgather = any(choices[l.name].route == ROUTE_ALLREDUCE and l.gradient == "sparse" for l in loads)
    exchanged = sum(choices[l.name].route == ROUTE_ALLTOALL and l.gradient == "sparse" for l in loads)
    collectives = tuple([a + b + c for a, b, c in zip(traffic[RING][i], traffic[GATHER][i], traffic[EXCHANGE][i])]
                        for i in (0, 1))
    network, collective = (max(max(tx), max(rx)) / cluster.bandwidth_bytes_per_s if N > 1 else 0.0
                           for tx, rx in (traffic[POINT], collectives))
    hop = 2 * cluster.delay_s                      # host -> bridge -> host
    latency = 0.0
    if N > 1 and has_ar and H > 1:
        latency += 2 * (N - 1) * hop               # one fused ring AllReduce
    if N > 1 and has_allgather:
        # collectives of their own beside the AllReduce (indices, then values): N - 1 messages
        # each, every one received before it is passed on; a message costs about what a PS
        # round trip does (the calibrated constant: gloo has no calibration of its own)
        latency += 2 * (N - 1) * (hop + cluster.rpc_overhead_s)
    if N > 1 and has_ps:
        latency += 3 * 2 * hop + 3 * cluster.rpc_overhead_s   # push, take + token, pull
    if N > 1 and exchanged:
        # three exchanges, one after another (ids, rows, gradient rows; every table in each),
        # each two gloo alltoalls (Horovod's of the splits, then the data); gloo posts a rank's
        # messages to every other rank at once, so an alltoall is one round, whatever the ranks
        latency += 3 * 2 * (hop + cluster.rpc_overhead_s)
    # a step takes at least the CPU work of the busiest host's rank (it waits for that one);
    # ranks sharing fewer cores (emulation) take turns
    per_host = host_cpu_terms(loads, choices, cluster, flows)
    cpu_bound = max(cpu_s(terms, cluster, compute_s) for terms in per_host) * cluster.cpu_turns
    exchange = {k: per_host[0][k] for k in ("exchange", "exchange_table")}     # alike on every host
    exchange_cpu = cpu_s(exchange, cluster, 0.0) * cluster.cpu_turns
    return Prediction(compute_s=compute_s, network_s=network, latency_s=latency,
                      server_s=max(messages) * cluster.message_overhead_s if N > 1 else 0.0,
                      cpu_bound_s=cpu_bound, collective_s=collective, exchange_cpu_s=exchange_cpu)
