"""What a plan moves over the links: per variable and host, the bytes each way and the graph
runs a server host handles.

Per step, every host link carries (each direction, full duplex):
  AllReduce, dense b bytes        ring over N ranks: 2(N-1)/N * b leaves and enters each host
  allgather, a bytes per rank     ring: (N-1) * a per host
  PS, P shards over the hosts     each host pushes the union of its ranks' rows and every rank
                                  pulls its distinct rows; a host serving s of the P shards
                                  receives/sends s/P of every other host's share (fan-in)
  alltoall, u distinct rows       the (N-L)/N other hosts own leave: ids out, rows back,
                                  gradient rows out; as much arrives for the rows it serves
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from parallax_tf.costmodel.cluster import Cluster
from parallax_tf.plan import ROUTE_ALLREDUCE, ROUTE_ALLTOALL, ROUTE_PS

INDEX_BYTES = 8


@dataclasses.dataclass
class Load:
    """What one variable asks of the network per rank per step (from inspect)."""
    name: str
    bytes: int
    gradient: str                 # sparse | dense | none
    row_bytes: int
    rows: int                     # table rows
    rows_touched: int = 0         # distinct rows one rank touches
    gathered_bytes: int = 0       # bytes its lookups return for one rank, repeats included
    partitioned: bool = False     # the model partitioned it itself
    dynamic: bool = False         # a dynamic table: on the servers (PS), or replicated (its pushes allgathered)


@dataclasses.dataclass
class Choice:
    route: str
    partitions: int = 1


def host_traffic(load: Load, choice: Choice, cluster: Cluster,
                 shard_hosts: Optional[List[int]] = None) -> Tuple[List[float], List[float], List[int]]:
    """(tx, rx) bytes per host and messages per server host for one variable in one step; its
    PS shards on `shard_hosts` (default: round robin from host 0)."""
    H, L, N = cluster.hosts, cluster.ranks_per_host, cluster.ranks
    tx, rx, messages = [0.0] * H, [0.0] * H, [0] * H
    if N == 1 or load.gradient == "none" or H == 1 and choice.route == ROUTE_ALLREDUCE:
        return tx, rx, messages
    if choice.route == ROUTE_ALLTOALL:    # rows the host's own ranks own stay on it
        each = L * (N - L) / N * load.rows_touched * (2 * load.row_bytes + INDEX_BYTES)
        return [each] * H, [each] * H, messages
    if choice.route == ROUTE_ALLREDUCE:
        if load.gradient == "sparse":
            per_hop = (N - 1) * allgathered_bytes(load)
        else:
            per_hop = 2 * (N - 1) / N * load.bytes
        return [per_hop] * H, [per_hop] * H, messages
    shards = max(1, choice.partitions)
    served = [0] * H                               # shards per host
    for shard in range(shards):
        served[shard_hosts[shard] if shard_hosts else shard % H] += 1
    if load.gradient == "sparse":
        # up: the host's gradient rows with their ids, and each rank's distinct ids to pull;
        # down: each rank's distinct rows (duplicates are expanded on the worker)
        push = min(load.rows, L * load.rows_touched) * (load.row_bytes + INDEX_BYTES) \
            + L * load.rows_touched * INDEX_BYTES
        pull = L * load.rows_touched * load.row_bytes
    else:
        push, pull = load.bytes, L * load.bytes
    for host in range(H):
        mine = served[host] / shards               # the part of every host's traffic this host serves
        away = 1 - mine
        tx[host] += away * push + (H - 1) * mine * pull
        rx[host] += away * pull + (H - 1) * mine * push
        # a rank's step is one graph run per PS task it touches, whatever the shards there
        messages[host] = N if served[host] else 0
    return tx, rx, messages


def allgathered_bytes(load: Load) -> int:
    """What one rank contributes to an allgather of this sparse gradient: its rows and their ids."""
    return load.gathered_bytes + load.gathered_bytes // max(1, load.row_bytes) * INDEX_BYTES


RING, GATHER, POINT, EXCHANGE = "ring", "allgather", "ps", "alltoall"   # host_traffic's cases


def _kind(load: Load, choice: Choice) -> str:
    if choice.route == ROUTE_ALLTOALL:
        return EXCHANGE
    if choice.route != ROUTE_ALLREDUCE:
        return POINT
    return GATHER if load.gradient == "sparse" else RING


def traffic_by_kind(loads: List[Load], choices: Dict[str, Choice],
                    cluster: Cluster) -> Tuple[Dict[str, tuple], List[int], set]:
    """(tx, rx) per host by kind (ring AllReduce, allgather, PS), the graph runs each server host
    handles, summed over the variables, and the hosts whose PS task a rank's graph runs on each
    step: those holding shards, and the global step's (host 0)."""
    H = cluster.hosts
    traffic = {kind: ([0.0] * H, [0.0] * H) for kind in (RING, GATHER, POINT, EXCHANGE)}
    messages = [0] * H
    placed = shard_hosts(loads, choices, cluster)
    for load in loads:
        t, r, m = host_traffic(load, choices[load.name], cluster, placed.get(load.name))
        kind = _kind(load, choices[load.name])
        tx, rx = traffic[kind]
        traffic[kind] = ([a + b for a, b in zip(tx, t)], [a + b for a, b in zip(rx, r)])
        messages = [max(a, b) for a, b in zip(messages, m)]
    servers = {host for hosts in placed.values() for host in hosts}
    return traffic, messages, servers | {0} if servers else set()


def mean_received(traffic: Dict[str, tuple], kinds, cluster: Cluster) -> float:
    """Bytes a rank receives per step by these kinds of traffic, the mean over ranks."""
    return sum(sum(traffic[kind][1]) for kind in kinds) / cluster.ranks


def received_bytes(loads: List[Load], choices: Dict[str, Choice], cluster: Cluster) -> float:
    """Bytes a rank receives per step by allgather or alltoall, pulled from a PS or pushed to
    the PS its host serves, the mean over ranks (a host serving a hot shard spends more). Each
    byte costs CPU: (de)serialisation and copies, and the TF ops that expand, sum and apply the rows."""
    return mean_received(traffic_by_kind(loads, choices, cluster)[0], (GATHER, POINT, EXCHANGE), cluster)


def runs_through_master(loads: List[Load], choices: Dict[str, Choice]) -> bool:
    """Whether a rank's step goes through TF's gRPC master: it does when a PS holds a variable
    that trains (the others run in a session of the rank's own process)."""
    return any(choices[l.name].route == ROUTE_PS and l.gradient != "none" for l in loads)


def shard_hosts(loads, choices, cluster) -> Dict[str, List[int]]:
    """The host of each PS shard, as the planner places them: the largest variables first, each
    shard on the host holding the fewest bytes so far."""
    load_by_server, placed = [0] * cluster.hosts, {}
    for load in sorted(loads, key=lambda l: -l.bytes):
        choice = choices[load.name]
        if choice.route != ROUTE_PS or load.gradient == "none":
            continue
        placed[load.name] = []
        for _ in range(max(1, choice.partitions)):
            server = min(range(cluster.hosts), key=lambda s: (load_by_server[s], s))
            load_by_server[server] += load.bytes // max(1, choice.partitions)
            placed[load.name].append(server)
    return placed
