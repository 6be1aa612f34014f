"""A rank's CPU per step: what multiplies each calibrated term on each host (the step takes at
least the busiest host's rank's CPU: the compute, the runtime and more of it per other rank and
through TF's gRPC master, each PS task in another process it runs on, each graph run its own
host's PS task serves, each byte it receives: ring AllReduce bytes at their own rate). Measured
on 8 emulated hosts (lm, hybrid, 1 Gbit): the three ranks whose hosts served shards spent 24-28
ms per step, the other five 16-17, and the step took the busiest one's CPU on its quota. The CPU
constants come from tools.calibrate."""
from __future__ import annotations

from typing import Dict, List, Optional

from parallax_tf.costmodel.cluster import Cluster
from parallax_tf.costmodel.traffic import (EXCHANGE, GATHER, POINT, RING, Choice, Load, mean_received,
                                           runs_through_master, traffic_by_kind)
from parallax_tf.plan import ROUTE_ALLREDUCE, ROUTE_ALLTOALL

# the calibrated CPU terms (tools.calibrate fits them) and the Cluster constant of each
CPU_TERMS = {"runtime": "runtime_cpu_s", "peer": "peer_cpu_s", "master": "master_cpu_s", "task": "task_cpu_s",
             "served": "serve_cpu_s", "received": "received_cpu_s_per_byte", "ring": "ring_cpu_s_per_byte",
             "replica": "replica_cpu_s_per_byte", "exchange": "exchange_cpu_s",
             "exchange_table": "exchange_table_cpu_s"}


def host_cpu_terms(loads: List[Load], choices: Dict[str, Choice], cluster: Cluster,
                   flows: Optional[tuple] = None) -> List[Dict[str, float]]:
    """Per host, what multiplies each CPU term in the step of its first rank: 1 (runtime),
    the other ranks, 1 if the step runs through TF's gRPC master, the PS tasks in other
    processes it runs a partition on (its host's own task is in its process: runtime.placement),
    the graph runs its own PS task serves, and the bytes it receives by allgather or PS (the
    pushes its task serves included) and by ring AllReduce, and the bytes of the dense
    variables it keeps a replica of (it applies their update and copies their gradient into and
    out of Horovod's fusion buffer, whatever the ranks: in the lm and cnn calibration runs the
    CPU per ring byte fell from 2 ranks to 8, which one term per ring byte cannot fit), and
    for the alltoall route the other ranks if any table takes it (its exchanges' messages) and
    its tables."""
    traffic, messages, servers = flows or traffic_by_kind(loads, choices, cluster)   # flows: predict's own
    master = float(runs_through_master(loads, choices))
    replicas = float(sum(l.bytes for l in loads if l.gradient == "dense" and choices[l.name].route == ROUTE_ALLREDUCE))
    exchanged = float(sum(choices[l.name].route == ROUTE_ALLTOALL and l.gradient == "sparse" for l in loads))
    L = cluster.ranks_per_host
    return [{"runtime": 1.0, "peer": float(cluster.ranks - 1), "master": master,
             "task": float(len(servers) - (host in servers)), "served": float(messages[host]),
             "received": (traffic[GATHER][1][host] + traffic[POINT][1][host] + traffic[EXCHANGE][1][host]) / L,
             "ring": traffic[RING][1][host] / L, "replica": replicas,
             "exchange": float(cluster.ranks - 1) * (exchanged > 0), "exchange_table": exchanged}
            for host in range(cluster.hosts)]


def host_cpu_s(loads: List[Load], choices: Dict[str, Choice], cluster: Cluster, compute_s: float,
               flows: Optional[tuple] = None) -> List[float]:
    """CPU per step of each host's first rank: its compute and the calibrated terms."""
    return [cpu_s(terms, cluster, compute_s) for terms in host_cpu_terms(loads, choices, cluster, flows)]


def cpu_s(terms: Dict[str, float], cluster: Cluster, compute_s: float) -> float:
    """Seconds of CPU: the compute and each term times its calibrated constant."""
    return compute_s + sum(getattr(cluster, CPU_TERMS[k]) * v for k, v in terms.items())


def received_cpu_s(loads: List[Load], choices: Dict[str, Choice], cluster: Cluster) -> float:
    """CPU a rank spends per step on the bytes it receives (the mean over ranks): ring AllReduce
    bytes at their own rate (gloo copies and sums them in place; calibrated apart with a model
    whose gradients are all dense), allgathered and PS bytes at received_bytes' rate."""
    traffic = traffic_by_kind(loads, choices, cluster)[0]
    return cluster.ring_cpu_s_per_byte * mean_received(traffic, (RING,), cluster) \
        + cluster.received_cpu_s_per_byte * mean_received(traffic, (GATHER, POINT, EXCHANGE), cluster)
