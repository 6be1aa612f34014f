"""Stanza's planning rule: which ranks are FC nodes, whom each serves, how their sends go, and
the route of every variable (the FC head's on the FC nodes, the rest AllReduced among the conv
nodes)."""
from __future__ import annotations

from parallax_tf import strategy
from parallax_tf.errors import ConfigError, ModelError
from parallax_tf.plan import ROUTE_ALLREDUCE, human_bytes
from rewriters.stanza import cost as stanza_cost
from rewriters.stanza.measure import found_head
from rewriters.stanza.split import ROUTE_FC_NODE, LayerSplit


def decide(request) -> strategy.Decisions:
    options, capture = request.options, request.capture
    split = layer_split(capture, request.num_ranks, options.fc_nodes, options.microbatches, options.sends,
                        request.cost_cluster)
    head = found_head(capture).head
    where = ", ".join(t.name for t in split.cut if t.kind != "replicated")
    routes, params = {}, {}
    for info in capture.variables:
        if info.name in head.variables:
            routes[info.name] = (ROUTE_FC_NODE, (f"FC head (it begins at {where}): trained on FC node(s) "
                                                 f"{split.fc_ranks} on the activations of the conv nodes they "
                                                 "serve; its gradient never leaves them"))
            params[info.name] = {"ranks": split.fc_ranks}
            continue
        how = "allgather of IndexedSlices" if info.gradient == "sparse" else "ring AllReduce"
        routes[info.name] = (ROUTE_ALLREDUCE, (f"below the FC head: trained on the conv nodes {split.conv_ranks}, "
                                               f"gradients summed among them ({how})"))
        params[info.name] = {"ranks": split.conv_ranks}
    state = {s.name: (split.fc_ranks, "updated on the FC nodes") if s.name in head.state
             else (split.conv_ranks, "updated on the conv nodes") for s in capture.state}
    return strategy.Decisions(routes, params=params, state=state, section=split)


def layer_split(capture, num_ranks: int, fc_nodes: int = 1, microbatches: int = 1, sends: str = "auto",
                cluster=None) -> LayerSplit:
    """Stanza: the last `fc_nodes` ranks train the FC head; the others (conv nodes) are split
    into as even contiguous groups, one per FC node. `sends`: a group's conv nodes send
    "together", "staggered", or "auto": staggered where together they would overflow the FC
    node's port on `cluster` (a costmodel.Cluster; None: together). `capture`: inspect_graph's."""
    found = found_head(capture)
    if found.head is None:
        raise ModelError(f"--strategy stanza: {found.problem}")
    if not 1 <= fc_nodes < num_ranks:
        raise ConfigError(f"--fc_nodes={fc_nodes} with {num_ranks} rank(s): stanza needs at least one FC node and "
                          f"one conv node (1 <= --fc_nodes < ranks); start more ranks or use --strategy hybrid")
    conv = list(range(num_ranks - fc_nodes))
    if fc_nodes > len(conv):
        raise ConfigError(f"--fc_nodes={fc_nodes} exceeds the {len(conv)} conv node(s) they would serve; use at "
                          f"most {len(conv)} FC nodes or more ranks")
    if microbatches < 1:
        raise ConfigError(f"--stanza_microbatches must be >= 1, got {microbatches}")
    sparse_head = [v.name for v in capture.variables if v.name in found.head.variables and v.gradient == "sparse"]
    if fc_nodes > 1 and sparse_head:
        raise ConfigError(f"--fc_nodes={fc_nodes} with a sparse gradient in the FC head ({sparse_head[0]!r}): FC "
                          "nodes sum only dense head gradients among themselves; use --fc_nodes=1")
    batch_state = [s.name for s in capture.state if s.per_rank]
    if microbatches > 1 and batch_state:
        raise ConfigError(f"--stanza_microbatches={microbatches} with model state computed from the batch "
                          f"({batch_state[0]!r}, e.g. batch norm): each micro-batch would have its own batch "
                          "statistics, so training would differ from single-device; use --stanza_microbatches=1")
    if microbatches > 1 and capture.metrics:
        raise ConfigError(f"--stanza_microbatches={microbatches} with Model(metrics=...) ({capture.metrics[0]!r}): "
                          "the FC node computes the metrics on the batch it receives whole; use "
                          "--stanza_microbatches=1 or drop the metrics")
    if sends not in ("auto", "together", "staggered"):
        raise ConfigError(f"--stanza_sends={sends}: choose auto, together or staggered")
    bounds = [round(i * len(conv) / fc_nodes) for i in range(fc_nodes + 1)]
    groups = [conv[bounds[i]:bounds[i + 1]] for i in range(fc_nodes)]
    staggered, why = _sends(found, max(map(len, groups)), microbatches, sends, cluster)
    return LayerSplit(conv_ranks=conv, fc_ranks=list(range(len(conv), num_ranks)), groups=groups,
                      cut=list(found.head.cut), microbatches=microbatches, staggered=staggered, sends_reason=why)


def _sends(found, group: int, microbatches: int, sends: str, cluster):
    """Whether a group's conv nodes send one at a time, and why."""
    if sends != "auto":
        return sends == "staggered", f"{sends} (--stanza_sends)"
    if cluster is None:
        return False, "together (no cluster to plan for)"

    activations = (found.batch_size or 1) * sum(t.bytes_per_example for t in found.head.cut
                                                  if t.kind == "activation")
    burst, queue = stanza_cost.fan_in(group, activations, cluster, microbatches)
    staggered = stanza_cost.staggers(group, activations, cluster, microbatches)
    return staggered, (f"{'staggered' if staggered else 'together'}: {group} conv node(s) send "
                       f"{human_bytes(burst)} at once, the FC node's port queues {human_bytes(queue)}")
