"""plan: decide a route for every variable the inspect stage found."""
from __future__ import annotations

import math
from typing import List, Optional

from parallax_tf import layer_cut, pipeline_cut
from parallax_tf.errors import ConfigError
from parallax_tf.inspect_graph import Capture, VariableInfo
from parallax_tf.plan import (ROUTE_ALLREDUCE, ROUTE_ASYNC_PS, ROUTE_FC_NODE, ROUTE_LOCAL, ROUTE_PS, ROUTE_SIGNIFICANT,
                              ROUTE_STAGE, LayerSplit, Pipeline, Plan, Shard, VariablePlan)

STRATEGIES = ("hybrid", "ps", "allreduce", "auto", "slim_dp", "ps_plus", "stanza", "dsp")
FUSION_BYTES = 64 * 2**20   # Horovod's default fusion buffer: one fused AllReduce per group
# A significant-route variable with at least this many elements has its global copy split over
# every server: each host's link then carries 1/H of the round's traffic, not all of it on one.
SPLIT_ELEMENTS = 1 << 16


def make_plan(capture: Capture, strategy: str, num_ranks: int, num_hosts: int,
              partitions: Optional[int] = None, local_aggregation: bool = True, cost_cluster=None,
              route_options: Optional[dict] = None, auto_stanza: bool = False) -> Plan:
    """`cost_cluster` (a costmodel.Cluster) is what --strategy=auto optimises for and what the
    shard count of every sparse PS variable is chosen for (default: num_hosts hosts at the
    cost model's defaults); `partitions` forces that count; `auto_stanza`: auto may choose
    Stanza, which trains on fewer batches per step (its FC nodes read no data);
    `route_options` maps a route to the options its variables carry in their params (Slim-DP's
    on "significant", PS+'s on "async_ps")."""
    route_options = route_options or {}
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if partitions is not None and partitions < 1:
        raise ConfigError(f"--partitions must be >= 1, got {partitions}")
    server_load = [0] * num_hosts
    entries = []
    auto = _auto_choices(capture, cost_cluster) if strategy == "auto" else {}
    stanza = _auto_stanza(capture, cost_cluster, auto) if auto else None
    if stanza is not None and not auto_stanza:     # say so, and keep the batch the user chose
        fc_nodes, why = stanza
        auto = {name: (choice, f"{reason}; stanza predicted faster per batch ({why}) but not chosen: its FC "
                               f"node(s) read no data, so a step would train on {_batches(num_ranks - fc_nodes)} "
                               f"instead of {num_ranks} (--auto_stanza allows it)")
                for name, (choice, reason) in auto.items()}
    elif stanza is not None:        # the cost model prefers layer separation: plan that instead
        fc_nodes, why = stanza
        plan = make_plan(capture, "stanza", num_ranks, num_hosts, partitions, local_aggregation, cost_cluster,
                         route_options={**route_options, ROUTE_FC_NODE: {
                             **route_options.get(ROUTE_FC_NODE, {}), "fc_nodes": fc_nodes}})
        for entry in plan.variables:
            entry.reason = f"auto chose stanza ({why}; one batch per conv node): {entry.reason}"
        return plan
    split = layer_cut.layer_split(capture, num_ranks, **route_options.get(ROUTE_FC_NODE, {}), cluster=cost_cluster) \
        if strategy == "stanza" else None
    pipeline = pipeline_cut.pipeline_split(capture, num_ranks, **route_options.get(ROUTE_STAGE, {})) \
        if strategy == "dsp" else None
    stage_of = {name: stage.index for stage in pipeline.stages for name in stage.variables} if pipeline else {}
    decided = []
    for info in capture.variables:
        route, reason = auto[info.name] if auto else _route(strategy, info, split, capture.head)
        if pipeline is not None:
            route, reason = _stage_route(info, stage_of, pipeline)
        decided.append((info, route.route if auto else route, reason))
    counts = {n: (c.partitions, "the cost model") for n, (c, _) in auto.items()} if auto else \
        _modelled_partitions(capture, {i.name: r for i, r, _ in decided}, num_ranks, num_hosts, cost_cluster)
    for info, route, reason in decided:
        entry = VariablePlan(name=info.name, shape=info.shape, dtype=info.dtype, bytes=info.bytes,
                             gradient=info.gradient, layer=info.layer, route=route, reason=reason,
                             bytes_per_step=0, user_partitioned=info.user_partitioned)
        if route not in (ROUTE_FC_NODE, ROUTE_STAGE):
            entry.params.update(route_options.get(route, {}))
        if route == ROUTE_STAGE:
            stage = pipeline.stages[stage_of.get(info.name, 0)]
            entry.params.update(stage=stage.index, ranks=stage.ranks)
        if split is not None:        # who shares the variable: the FC nodes, or the conv nodes
            entry.params["ranks"] = split.fc_ranks if route == ROUTE_FC_NODE else split.conv_ranks
        if route in (ROUTE_PS, ROUTE_ASYNC_PS):
            count = (partitions, "--partitions") if partitions is not None else counts.get(info.name, (1, ""))
            _shard(entry, info, count, num_hosts, server_load)
        if route == ROUTE_ASYNC_PS:
            _async_copies(entry)
        elif route == ROUTE_SIGNIFICANT:
            _split_elements(entry, info, num_hosts, server_load)
        entry.bytes_per_step = estimate_bytes_per_step(entry, info, len(entry.params.get("ranks", range(num_ranks))))
        entries.append(entry)
    _assign_fusion_groups([e for e in entries if e.route == ROUTE_ALLREDUCE and e.gradient == "dense"])
    for state in capture.state:
        how = ("updated from each rank's batch: each rank keeps its own, the mean over ranks is read"
               if state.per_rank else "the same on every rank: rank 0's copy is read")
        if strategy == "ps_plus":   # no point where all ranks could average it
            how = "each rank keeps its own (ranks run asynchronously): rank 0's copy is read"
        params = {"combine": "mean" if state.per_rank and strategy != "ps_plus" and state.dtype.startswith(
            ("float", "bfloat", "half", "double")) else "rank0"}
        if split is not None:       # kept by the nodes that update it
            in_head = state.name in capture.head.state
            params["ranks"] = split.fc_ranks if in_head else split.conv_ranks
            how += f"; updated on the {'FC' if in_head else 'conv'} nodes"
        entries.append(VariablePlan(name=state.name, shape=state.shape, dtype=state.dtype, bytes=state.bytes,
                                    gradient="none", layer=state.layer, route=ROUTE_LOCAL,
                                    reason=f"model state, not trained: {how}", bytes_per_step=0, params=params))
    return Plan(strategy=strategy, num_ranks=num_ranks, num_hosts=num_hosts, servers=[],
                local_aggregation=local_aggregation, variables=entries, global_step=capture.global_step, split=split,
                pipeline=pipeline)


# the cost model that picks routes (auto) and shard counts (every PS route) needs a step's compute;
# stanza's whether to stagger its sends, the batch's size (timed with the head)
MEASUREMENTS = {"auto": {"time_compute": True}, "hybrid": {"time_compute": True}, "ps": {"time_compute": True},
                "ps_plus": {"time_compute": True}, "stanza": {"time_compute": True}, "dsp": {"pipeline": True}}


def measurements(strategy: str) -> dict:
    """What capture must measure for the planner to plan `strategy` (keyword arguments)."""
    return MEASUREMENTS.get(strategy, {})


def _stage_route(info: VariableInfo, stage_of: dict, pipeline: Pipeline):
    stage = pipeline.stages[stage_of.get(info.name, 0)]
    if info.name not in stage_of:
        return ROUTE_STAGE, "no gradient reaches it from the loss: kept by stage 0, never updated"
    how = f"gradients averaged over its {pipeline.replicas} replicas" if pipeline.replicas > 1 else "one copy"
    return ROUTE_STAGE, (f"pipeline stage {stage.index} (staleness {pipeline.staleness[stage.index]}): trained by "
                         f"rank(s) {stage.ranks}, {how}")


def _auto_choices(capture: Capture, cluster):
    """Route and shard count per variable from the cost model, with the predicted step time."""
    from parallax_tf import costmodel
    if cluster is None:
        raise ConfigError("--strategy=auto needs the cluster it plans for (hosts, link bandwidth)")
    loads = costmodel.loads_from(capture)
    compute = capture.compute_s or 0.0
    choices = costmodel.choose(loads, cluster, compute)
    step = costmodel.predict(loads, choices, cluster, compute).step_s
    out = {}
    for load in loads:
        choice = choices[load.name]
        alternatives = ", ".join(
            f"{c.route}{'x' + str(c.partitions) if c.route == ROUTE_PS else ''} "
            f"{costmodel.predict(loads, {**choices, load.name: c}, cluster, compute).step_s * 1000:.1f}ms"
            for c in costmodel.candidates(load, cluster) if c != choice)
        out[load.name] = (choice, f"cost model: predicted step {step * 1000:.1f}ms; instead: {alternatives}")
    return out


def _batches(n: int) -> str:
    return f"{n} batch" if n == 1 else f"{n} batches"


def _auto_stanza(capture: Capture, cluster, auto: dict):
    """(FC nodes, why) when the cost model predicts Stanza to train a batch 5% or more faster than
    the per-variable plan, else None. (Stanza on 2 ranks is 1 conv node: half the batches a step.)"""
    from parallax_tf import costmodel, stanza_cost
    split = stanza_cost.layer_split_load(capture)
    if split is None or cluster.ranks < 2:
        return None
    if any(s.name in capture.head.state for s in capture.state):
        return None                 # batch norm inside the head: no test covers it yet, stay data parallel
    loads = costmodel.loads_from(capture)
    compute = capture.compute_s or 0.0
    per_variable = costmodel.predict(loads, {name: choice for name, (choice, _) in auto.items()}, cluster,
                                     compute).step_s
    fc_nodes, predicted = stanza_cost.choose_fc_nodes(loads, split, cluster, compute)
    ranks = cluster.ranks
    if not stanza_cost.prefers_stanza(predicted.step_s, fc_nodes, per_variable, ranks):
        return None
    return fc_nodes, (f"predicted {stanza_cost.per_batch_s(predicted.step_s, ranks, fc_nodes) * 1000:.1f}ms per batch "
                      f"with {fc_nodes} FC node(s), a {predicted.step_s * 1000:.1f}ms step of "
                      f"{_batches(ranks - fc_nodes)}, vs {stanza_cost.per_batch_s(per_variable, ranks) * 1000:.1f}ms "
                      f"data parallel, a {per_variable * 1000:.1f}ms step of {_batches(ranks)}")


def _route(strategy: str, info: VariableInfo, split: Optional[LayerSplit] = None, head=None):
    if strategy == "stanza":
        where = ", ".join(t.name for t in split.cut if t.kind != "replicated")
        if info.name in head.variables:
            return ROUTE_FC_NODE, (f"FC head (it begins at {where}): trained on FC node(s) {split.fc_ranks} on the "
                                   "activations of the conv nodes they serve; its gradient never leaves them")
        how = "allgather of IndexedSlices" if info.gradient == "sparse" else "ring AllReduce"
        return ROUTE_ALLREDUCE, (f"below the FC head: trained on the conv nodes {split.conv_ranks}, gradients summed "
                                 f"among them ({how})")
    if strategy == "ps_plus":
        if info.gradient == "sparse":
            return ROUTE_ASYNC_PS, ("strategy ps_plus, sparse gradient: on the PS, its rows read in the step; "
                                    "each push applied as it arrives, lr scaled by staleness")
        return ROUTE_ASYNC_PS, ("strategy ps_plus: global copy on the PS, pulled eagerly into a local copy; "
                                "each push applied as it arrives, lr scaled by staleness")
    if strategy == "slim_dp" and info.gradient == "dense":
        return ROUTE_SIGNIFICANT, ("dense gradient, strategy slim_dp: a local replica per rank; each round "
                                   "only the significant + explored coordinates are synchronised on the PS")
    if strategy == "ps":
        return ROUTE_PS, "strategy ps: every variable on parameter servers"
    if strategy == "allreduce":
        how = "allgather of IndexedSlices" if info.gradient == "sparse" else "ring AllReduce"
        return ROUTE_ALLREDUCE, f"strategy allreduce: {how}"
    if info.gradient == "sparse":
        return ROUTE_PS, ("sparse gradient (IndexedSlices): a PS moves only touched rows, "
                          "allgather would grow with the number of ranks")
    if info.gradient == "none":
        return ROUTE_ALLREDUCE, "no gradient reaches it from the loss: replicated, never updated"
    return ROUTE_ALLREDUCE, "dense gradient: ring AllReduce moves 2(N-1)/N of it with no hotspot"


def _shard(entry: VariablePlan, info: VariableInfo, count, num_hosts, load) -> None:
    if info.user_partitioned:
        pieces = list(zip(info.part_names, info.part_rows))
        entry.reason += f"; the model partitioned it into {len(pieces)}"
    else:
        count = _partition_count(info, count, entry)
        rows = info.shape[0] if info.shape else 1
        sizes = [rows // count + (1 if i < rows % count else 0) for i in range(count)]
        names = [f"{info.name}/part_{i}" for i in range(count)] if count > 1 else [info.name]
        pieces = list(zip(names, sizes))
    start = 0
    for name, rows in pieces:
        server = min(range(num_hosts), key=lambda s: (load[s], s))   # greedy by bytes
        load[server] += rows * info.row_bytes
        entry.shards.append(Shard(name=name, row_start=start, row_end=start + rows, server=server))
        start += rows


def _async_copies(entry: VariablePlan) -> None:
    """A dense async_ps variable (and a sparse one with sparse_pull "eager"): its global copy
    on the server under its own name, the model's variable (single-device name) is the rank's
    local copy, pulled eagerly. A sparse one otherwise: the model's variable itself lives on the
    server and the step reads its rows."""
    rows = entry.gradient == "sparse" and entry.params.get("sparse_pull", "rows") == "rows"
    entry.params["pull"] = "rows" if rows else "eager"
    if not rows and not entry.user_partitioned and len(entry.shards) > 1:
        # the local copy is one variable, so the global copy is one piece too
        first = entry.shards[0]
        entry.shards = [Shard(entry.name, 0, entry.shards[-1].row_end, first.server)]
        entry.reason += "; one piece: it is pulled whole into a local copy"
    if not rows:
        for shard in entry.shards:
            shard.name = f"{shard.name}/parallax_global"


def _split_elements(entry: VariablePlan, info: VariableInfo, num_hosts: int, load) -> None:
    """The global copy of a significant-route variable: its flattened elements in contiguous
    ranges, one per server for large variables, each with its own core set."""
    elements = max(1, math.prod(info.shape))
    count = num_hosts if elements >= SPLIT_ELEMENTS else 1
    sizes = [elements // count + (1 if i < elements % count else 0) for i in range(count)]
    start = 0
    for i, size in enumerate(sizes):
        server = min(range(num_hosts), key=lambda s: (load[s], s))
        load[server] += size * (info.bytes // elements)
        entry.shards.append(Shard(name=f"{info.name}/parallax_global/part_{i}", row_start=start,
                                  row_end=start + size, server=server))
        start += size
    entry.layout = "flat"
    if count > 1:
        entry.reason += f"; global copy split over {count} servers"


def _partition_count(info: VariableInfo, count, entry) -> int:
    """`count`: (shards wanted, who wants them)."""
    wanted, by = count
    rows = info.shape[0] if info.shape else 1
    if info.gradient != "sparse" or rows < 2:
        return 1
    if not info.from_get_variable:
        if wanted > 1:
            entry.reason += "; not partitioned: created by tf.Variable (use get_variable to partition)"
        return 1
    if by:
        entry.reason += f"; {min(wanted, rows)} partition(s) ({by})"
    return min(wanted, rows)


def _modelled_partitions(capture: Capture, routes: dict, num_ranks: int, num_hosts: int, cluster) -> dict:
    """Shard count of each sparse PS variable: the one with the shortest predicted step on
    `cluster` (costmodel.choose with the routes fixed), with why."""
    from parallax_tf import costmodel
    as_ps = {name: ROUTE_PS if route in (ROUTE_PS, ROUTE_ASYNC_PS) else route for name, route in routes.items()}
    if not any(r == ROUTE_PS and i.gradient == "sparse" for i in capture.variables for r in [as_ps[i.name]]):
        return {}
    cluster = cluster or costmodel.Cluster(num_hosts, max(1, -(-num_ranks // num_hosts)))
    loads = costmodel.loads_from(capture)
    compute = capture.compute_s or 0.0
    choices = costmodel.choose(loads, cluster, compute, routes=as_ps)
    out = {}
    for load in loads:
        if as_ps[load.name] != ROUTE_PS or load.gradient != "sparse":
            continue
        predicted = {c.partitions: costmodel.predict(loads, {**choices, load.name: c}, cluster, compute).step_s
                     for c in costmodel.candidates(load, cluster) if c.route == ROUTE_PS}
        chosen = choices[load.name].partitions
        others = ", ".join(f"{p}: {s * 1000:.1f}ms" for p, s in sorted(predicted.items()) if p != chosen)
        out[load.name] = (chosen, f"cost model: predicted step {predicted[chosen] * 1000:.1f}ms"
                                  f"{'; ' + others if others else ''}; constants: {cluster.calibration}")
    return out


def estimate_bytes_per_step(entry: VariablePlan, info: VariableInfo, num_ranks: int) -> int:
    """Bytes one rank sends plus receives for this variable in one step (plan-time estimate)."""
    if num_ranks <= 1 or info.gradient == "none":
        return 0
    if info.gradient == "sparse":
        rows = info.rows_touched if info.rows_touched is not None else info.shape[0]
        touched = rows * (info.row_bytes + 8)            # values + int64 index
        if entry.route in (ROUTE_PS, ROUTE_ASYNC_PS):
            return 2 * touched - rows * 8                # push grad rows, pull rows
        return (num_ranks - 1) * touched                 # allgather: everyone's rows arrive
    if entry.route in (ROUTE_PS, ROUTE_ASYNC_PS):
        return 2 * info.bytes                            # push gradient, pull variable
    if entry.route == ROUTE_SIGNIFICANT:                 # push + pull the selected values per round
        params = entry.params
        chosen = params.get("core", 1.0) + params.get("explore", 0.0)
        return int(2 * chosen * info.bytes / max(1, params.get("period", 1)))
    return int(2 * (num_ranks - 1) / num_ranks * info.bytes)


def _assign_fusion_groups(entries: List[VariablePlan]) -> None:
    group, filled = 0, 0
    for entry in entries:
        if filled and filled + entry.bytes > FUSION_BYTES:
            group, filled = group + 1, 0
        entry.fusion_group = group
        filled += entry.bytes
