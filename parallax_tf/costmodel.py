"""A cost model: predicted step time of a plan on a cluster, and the per-variable choice that
--strategy=auto makes with it (no relaunching, unlike the Parallax paper's partition search).

Per step, every host link carries (each direction, full duplex):
  AllReduce, dense b bytes        ring over N ranks: 2(N-1)/N * b leaves and enters each host
  allgather, a bytes per rank     ring: (N-1) * a per host
  PS, P shards over the hosts     each host pushes the union of its ranks' rows and every rank
                                  pulls its distinct rows; a host serving s of the P shards
                                  receives/sends s/P of every other host's share (fan-in)
  alltoall, u distinct rows       the (N-L)/N other hosts own leave: ids out, rows back,
                                  gradient rows out; as much arrives for the rows it serves
The busiest link sets the network time, for collectives and for PS traffic apart; round trips
add latency; each graph run a server handles costs a fixed overhead; compute is the measured
single-device CPU time. A step also takes at least the CPU of the busiest host's rank
(compute, runtime and more of it per other rank and through TF's gRPC master, each PS task in
another process it runs on, each graph run its own host's PS task serves, each byte it
receives: ring AllReduce bytes at their own rate), stretched when more ranks than cores share
a machine (as on an emulated cluster). Measured on 8 emulated hosts (lm, hybrid, 1 Gbit): the
three ranks whose hosts served shards spent 24-28 ms per step, the other five 16-17, and the
step took the busiest one's CPU on its quota. The CPU and per-message constants come from
tools.calibrate.

How the parts add up: PS transfers are each rank's own and overlap with its CPU work (and
with other ranks'), so they sit inside max(CPU bound, compute + PS network + server). A
collective is a barrier: every rank waits for it with nothing left to compute, so its link
time adds to the step, as round trips do (a CPU-bound rank still waits them out). On 39 runs
of the rig's sweep (1 Gbit and 100 Mbit, lm and cnn, 2-8 hosts) this cut the mean error from
22% (all overlapped) to 14%.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional, Tuple

from parallax_tf.calibration import Calibration, load as load_calibration
from parallax_tf.plan import ROUTE_ALLREDUCE, ROUTE_ALLTOALL, ROUTE_PS

_DEFAULTS = Calibration()
# what a switch port queues, in seconds of its link's rate: tools.netns's emulated links queue
# this much (its QUEUE_S); a real switch's buffer is its own figure
PORT_QUEUE_S = 0.2

INDEX_BYTES = 8


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
                   cores: Optional[int] = None, calibration: Optional[Calibration] = None) -> "Cluster":
        calibration = calibration or load_calibration()
        return cls(hosts, ranks_per_host, bandwidth_bytes_per_s, delay_s, cores=cores,
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


@dataclasses.dataclass
class Choice:
    route: str
    partitions: int = 1


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


def _traffic(loads: List[Load], choices: Dict[str, Choice], cluster: Cluster) -> Tuple[Dict[str, tuple], List[int], set]:
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


def _mean_received(traffic: Dict[str, tuple], kinds, cluster: Cluster) -> float:
    return sum(sum(traffic[kind][1]) for kind in kinds) / cluster.ranks


def received_bytes(loads: List[Load], choices: Dict[str, Choice], cluster: Cluster) -> float:
    """Bytes a rank receives per step by allgather or alltoall, pulled from a PS or pushed to
    the PS its host serves, the mean over ranks (a host serving a hot shard spends more). Each
    byte costs CPU: (de)serialisation and copies, and the TF ops that expand, sum and apply the rows."""
    return _mean_received(_traffic(loads, choices, cluster)[0], (GATHER, POINT, EXCHANGE), cluster)


def received_cpu_s(loads: List[Load], choices: Dict[str, Choice], cluster: Cluster) -> float:
    """CPU a rank spends per step on the bytes it receives (the mean over ranks): ring AllReduce
    bytes at their own rate (gloo copies and sums them in place; calibrated apart with a model
    whose gradients are all dense), allgathered and PS bytes at received_bytes' rate."""
    traffic = _traffic(loads, choices, cluster)[0]
    return cluster.ring_cpu_s_per_byte * _mean_received(traffic, (RING,), cluster) \
        + cluster.received_cpu_s_per_byte * _mean_received(traffic, (GATHER, POINT, EXCHANGE), cluster)


def runs_through_master(loads: List[Load], choices: Dict[str, Choice]) -> bool:
    """Whether a rank's step goes through TF's gRPC master: it does when a PS holds a variable
    that trains (the others run in a session of the rank's own process)."""
    return any(choices[l.name].route == ROUTE_PS and l.gradient != "none" for l in loads)


def predict(loads: List[Load], choices: Dict[str, Choice], cluster: Cluster, compute_s: float) -> Prediction:
    H, N = cluster.hosts, cluster.ranks
    flows = _traffic(loads, choices, cluster)
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
    cpu_bound = max(_cpu_s(terms, cluster, compute_s) for terms in per_host) * cluster.cpu_turns
    exchange = {k: per_host[0][k] for k in ("exchange", "exchange_table")}     # alike on every host
    exchange_cpu = _cpu_s(exchange, cluster, 0.0) * cluster.cpu_turns
    return Prediction(compute_s=compute_s, network_s=network, latency_s=latency,
                      server_s=max(messages) * cluster.message_overhead_s if N > 1 else 0.0,
                      cpu_bound_s=cpu_bound, collective_s=collective, exchange_cpu_s=exchange_cpu)


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
    traffic, messages, servers = flows or _traffic(loads, choices, cluster)   # flows: predict's own
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
    return [_cpu_s(terms, cluster, compute_s) for terms in host_cpu_terms(loads, choices, cluster, flows)]


def _cpu_s(terms: Dict[str, float], cluster: Cluster, compute_s: float) -> float:
    return compute_s + sum(getattr(cluster, CPU_TERMS[k]) * v for k, v in terms.items())


def candidates(load: Load, cluster: Cluster) -> List[Choice]:
    """AllReduce, or for a sparse variable the PS in a few shard counts and (one variable per
    table) the alltoall route. A dense one stays on
    AllReduce (the Parallax rule): the ring moves the fewest bytes there is, 2(N-1)/N of it,
    where a PS adds a hot server (its 1 shard; the planner partitions only sparse variables).
    Measured on the rig, cnn at 1 Gbit with its dense weights on the PS: 0.69x hybrid on 2
    hosts, 0.38x on 8, its CPU per rank 1.6-2.4x, its pulls not hidden behind other work."""
    options = [Choice(ROUTE_ALLREDUCE)]
    if load.gradient != "sparse":
        return options
    for shards in sorted({1, cluster.hosts, 2 * cluster.hosts, 4 * cluster.hosts}):
        if shards <= max(1, load.rows):
            options.append(Choice(ROUTE_PS, shards))
    if not load.partitioned:
        options.append(Choice(ROUTE_ALLTOALL))
    return options


CHOICE_MARGIN = 0.01      # predicted steps this close count as equal


def choose(loads: List[Load], cluster: Cluster, compute_s: float,
           routes: Optional[Dict[str, str]] = None) -> Dict[str, Choice]:
    """Per variable, the route (and shard count) that minimises the predicted step time, by
    coordinate descent from the Parallax rule (sparse on PS over every host, dense AllReduce)
    and from a few whole-model starts.
    With `routes` (name -> route, as a strategy fixed them) only the shard counts of sparse PS
    variables are chosen."""
    def parallax(load: Load) -> Choice:
        route = routes[load.name] if routes else (ROUTE_PS if load.gradient == "sparse" else ROUTE_ALLREDUCE)
        return Choice(route, cluster.hosts if route == ROUTE_PS and load.gradient == "sparse" else 1)

    def options(load: Load) -> List[Choice]:
        if routes is None:
            return candidates(load, cluster)
        if routes[load.name] != ROUTE_PS or load.gradient != "sparse":
            return [parallax(load)]
        return [c for c in candidates(load, cluster) if c.route == ROUTE_PS]

    def descend(choices: Dict[str, Choice]) -> Dict[str, Choice]:
        for _ in range(3):
            changed = False
            for load in sorted(loads, key=lambda l: -l.bytes):
                step = {i: predict(loads, {**choices, load.name: c}, cluster, compute_s).step_s
                        for i, c in enumerate(options(load))}
                fastest = min(step.values())
                # within the margin of the fastest: keep the route, then the fewest shards (each
                # one more task every step runs on, for a gain the model cannot resolve)
                best = min((c for i, c in enumerate(options(load)) if step[i] <= fastest * (1 + CHOICE_MARGIN)),
                           key=lambda c: (c.route != choices[load.name].route, c.partitions))
                if best != choices[load.name]:
                    choices[load.name], changed = best, True
            if not changed:
                break
        return choices

    # one variable at a time cannot see a cost shared by several (a PS task stays in every
    # step while any variable uses it), so the descent also starts from every sparse variable
    # in 1 shard and from every variable on AllReduce; the Parallax rule wins ties
    starts = [{l.name: parallax(l) for l in loads},
              {l.name: dataclasses.replace(parallax(l), partitions=1) for l in loads}]
    if routes is None:
        starts.append({l.name: Choice(ROUTE_ALLREDUCE) for l in loads})
        starts.append({l.name: Choice(ROUTE_ALLTOALL) if l.gradient == "sparse" and not l.partitioned
                       else Choice(ROUTE_ALLREDUCE) for l in loads})
    results = [descend(start) for start in starts]
    steps = [predict(loads, r, cluster, compute_s).step_s for r in results]
    return next(r for r, s in zip(results, steps) if s <= min(steps) * (1 + CHOICE_MARGIN))


def loads_from(capture) -> List[Load]:
    out = []
    for v in capture.variables:
        rows = v.shape[0] if v.shape else 1
        out.append(Load(name=v.name, bytes=v.bytes, gradient=v.gradient, row_bytes=v.row_bytes, rows=rows,
                        rows_touched=v.rows_touched or 0, gathered_bytes=v.gathered_bytes or 0,
                        partitioned=v.user_partitioned))
    return out
