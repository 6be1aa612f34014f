"""Stanza's cost model: the step time of training the FC head on dedicated FC nodes (conv nodes
send activations, FC nodes return their gradients, each group AllReduces its own variables),
priced with costmodel's links and calibrated CPU terms, and the FC node count auto would pick."""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from parallax_tf.costmodel import Choice, Cluster, Load, Prediction, predict, received_cpu_s
from parallax_tf.plan import ROUTE_ALLREDUCE
from parallax_tf.strategy import Offer


@dataclasses.dataclass
class LayerSplitLoad:
    """What Stanza's layer separation asks of a cluster (from inspect: the head, the cut)."""
    head: set                     # the FC head's variable names
    activation_bytes: int         # per example, crossing both ways (the FC node returns their gradient)
    data_bytes: int               # per example, forward only (labels)
    batch: int                    # examples per conv node per step
    head_compute_s: float         # the head's forward + backward on one batch


def layer_split_load(capture) -> Optional[LayerSplitLoad]:
    """What Stanza would move and compute, from a timed capture (None: no FC head, or untimed)."""
    from rewriters.stanza.measure import found_head
    found = found_head(capture)
    head = found.head
    if head is None or found.compute_s is None:
        return None
    return LayerSplitLoad(
        head=set(head.variables), batch=found.batch_size or 1, head_compute_s=found.compute_s,
        activation_bytes=sum(t.bytes_per_example for t in head.cut if t.kind == "activation"),
        data_bytes=sum(t.bytes_per_example for t in head.cut if t.kind == "data"))


# Linux's minimum TCP retransmission timeout: the least a lost segment delays its transfer
TCP_RTO_MIN_S = 0.2


def fan_in(group: int, activation_bytes: float, cluster: Cluster, microbatches: int = 1) -> Tuple[float, float]:
    """What reaches an FC node's port at once when its group sends together (`group` conv nodes'
    activations of one micro-batch, `activation_bytes` each per step; the gradients leaving at
    once are as many bytes), and what the port queues."""
    return group * activation_bytes / microbatches, cluster.bandwidth_bytes_per_s * cluster.port_queue_s


def staggers(group: int, activation_bytes: float, cluster: Cluster, microbatches: int = 1) -> bool:
    """Whether a group's conv nodes should send one at a time: exactly where sending together
    would overflow the FC node's port (TCP incast), so segments are lost and each loss waits
    out a retransmission timeout. Staggered, the port takes one conv node's at a time."""
    burst, queue = fan_in(group, activation_bytes, cluster, microbatches)
    return group > 1 and burst > queue


def predict_stanza(loads: List[Load], split: LayerSplitLoad, cluster: Cluster, compute_s: float, fc_nodes: int,
                   microbatches: int = 1, staggered: Optional[bool] = None) -> Prediction:
    """Step time of Stanza with `fc_nodes` FC nodes (one rank per host): conv nodes compute the
    extractor, each FC node receives its group's activations on its own link, computes the
    head for the group and returns the gradients; conv nodes then AllReduce the extractor
    (FC nodes the head's gradient meanwhile). Every transfer is a collective the nodes wait
    for, so the chain adds up as predict()'s collectives do: the conv node's CPU work, then
    the activations there, the FC node's CPU work, the gradients back, the AllReduce.
    Micro-batches pipeline the middle three: the longest is paid once, the others 1/M.
    `staggered` (default: what staggers() decides): one collective per conv node of a group
    each way instead of one; sending together where the port overflows costs a retransmission
    timeout per transfer each way."""
    conv = cluster.ranks - fc_nodes
    group = -(-conv // fc_nodes)
    conv_compute = max(compute_s - split.head_compute_s, 0.0)
    up = split.batch * (split.activation_bytes + split.data_bytes)       # per conv node, each way
    down = split.batch * split.activation_bytes
    extractor = [l for l in loads if l.name not in split.head]
    head = [l for l in loads if l.name in split.head]
    all_reduced = {l.name: Choice(ROUTE_ALLREDUCE) for l in loads}

    def allreduce(among: List[Load], hosts: int) -> float:
        if hosts < 2:
            return 0.0
        part = dataclasses.replace(cluster, hosts=hosts, ranks_per_host=1, cores=None)
        got = predict(among, all_reduced, part, 0.0)
        return got.network_s + got.collective_s + got.latency_s

    def sync_cpu(among: List[Load], hosts: int) -> float:
        """CPU of the bytes this group's AllReduce brings each node (ring, and allgathered rows)."""
        return received_cpu_s(among, all_reduced, dataclasses.replace(cluster, hosts=hosts, ranks_per_host=1))

    # each node's CPU per step as predict() counts it (compute, runtime, bytes it receives), on
    # its host's share of the cores
    per_byte, turns = cluster.received_cpu_s_per_byte, cluster.cpu_turns
    conv_cpu = conv_compute + cluster.runtime_cpu + per_byte * down + sync_cpu(extractor, conv)
    fc_cpu = split.head_compute_s * group + cluster.runtime_cpu + per_byte * group * up + sync_cpu(head, fc_nodes)
    stages = [group * up / cluster.bandwidth_bytes_per_s, fc_cpu * turns, group * down / cluster.bandwidth_bytes_per_s]
    pipeline = max(stages) + (sum(stages) - max(stages)) / microbatches
    conv_sync, fc_sync = allreduce(extractor, conv), allreduce(head, fc_nodes)
    # the FC nodes' AllReduce overlaps the conv nodes' backward (~2/3 of their compute) and theirs
    tail = conv_sync + max(0.0, fc_sync - 2 / 3 * conv_compute - conv_sync)
    # each micro-batch: sequential collectives there and back (one, or one per conv node of a
    # group staggered), each a Horovod negotiation round besides the links' delay
    overflows = staggers(group, split.batch * split.activation_bytes, cluster, microbatches)
    staggered = overflows if staggered is None else staggered
    rounds = 2 * microbatches * (group if staggered else 1) * (cluster.rpc_overhead_s + 2 * cluster.delay_s)
    if overflows and not staggered:
        rounds += 2 * microbatches * TCP_RTO_MIN_S
    return Prediction(compute_s=conv_compute, network_s=0.0, latency_s=rounds, server_s=0.0,
                      cpu_bound_s=conv_cpu * turns, collective_s=pipeline + tail)


STANZA_MARGIN = 0.95    # auto switches to stanza only when predicted at least 5% faster per batch


def per_batch_s(step_s: float, ranks: int, fc_nodes: int = 0) -> float:
    """Seconds per batch trained. Stanza's FC nodes read no data: its step trains ranks - fc_nodes
    batches where data parallelism trains ranks, so throughput compares these, not step times."""
    return step_s / (ranks - fc_nodes)


def prefers_stanza(stanza_s: float, fc_nodes: int, data_parallel_s: float, ranks: int) -> bool:
    return per_batch_s(stanza_s, ranks, fc_nodes) <= STANZA_MARGIN * per_batch_s(data_parallel_s, ranks)


def choose_fc_nodes(loads: List[Load], split: LayerSplitLoad, cluster: Cluster, compute_s: float,
                    microbatches: int = 1) -> Tuple[int, Prediction]:
    """The FC node count with the shortest predicted time per batch trained (at most half the
    ranks), and its prediction."""
    options = range(1, max(1, cluster.ranks // 2) + 1)
    return min(((f, predict_stanza(loads, split, cluster, compute_s, f, microbatches)) for f in options),
               key=lambda item: (per_batch_s(item[1].step_s, cluster.ranks, item[0]), item[0]))


def batches(n: int) -> str:
    return f"{n} batch" if n == 1 else f"{n} batches"


def offer(request, data_parallel_s: float, options):
    """Stanza as a whole-plan alternative (strategy.Offer) where the cost model predicts it to
    train a batch 5% or more faster than data parallelism's `data_parallel_s` step, else None.
    (Stanza on 2 ranks is 1 conv node: half the batches a step.)"""
    from rewriters.stanza.measure import found_head
    capture, cluster = request.capture, request.cost_cluster
    split = layer_split_load(capture)
    if split is None or cluster.ranks < 2:
        return None
    if any(s.name in found_head(capture).head.state for s in capture.state):
        return None                 # batch norm inside the head: no test covers it yet, stay data parallel
    fc_nodes, predicted = choose_fc_nodes(request.loads, split, cluster, capture.compute_s or 0.0)
    ranks = cluster.ranks
    if not prefers_stanza(predicted.step_s, fc_nodes, data_parallel_s, ranks):
        return None
    why = (f"predicted {per_batch_s(predicted.step_s, ranks, fc_nodes) * 1000:.1f}ms per batch "
           f"with {fc_nodes} FC node(s), a {predicted.step_s * 1000:.1f}ms step of "
           f"{batches(ranks - fc_nodes)}, vs {per_batch_s(data_parallel_s, ranks) * 1000:.1f}ms "
           f"data parallel, a {data_parallel_s * 1000:.1f}ms step of {batches(ranks)}")
    return Offer(options=dataclasses.replace(options, fc_nodes=fc_nodes), why=why, batches=ranks - fc_nodes)
