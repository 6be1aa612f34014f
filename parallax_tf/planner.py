"""plan: decide a route for every variable the inspect stage found.

The strategy's rule (parallax_tf.strategy) decides each variable's route; this module does what
every strategy shares: the plan's entries, sharding of parameter-server variables (the count the
cost model predicts fastest), AllReduce fusion groups, model state, byte estimates.
"""
from __future__ import annotations

import dataclasses
from typing import List

from parallax_tf import routes as route_lib, strategy as strategy_lib
from parallax_tf.errors import ConfigError
from parallax_tf.inspect_graph import Capture, VariableInfo
from parallax_tf.plan import (DYNAMIC_ON_SERVERS, DYNAMIC_REPLICATED, ROUTE_ALLREDUCE, ROUTE_LOCAL, ROUTE_PS,
                             DynamicTablePlan, Plan, Shard, VariablePlan)
from parallax_tf.strategy import Decisions, PlanRequest

FUSION_BYTES = 64 * 2**20   # Horovod's default fusion buffer: one fused AllReduce per group


def make_plan(request: PlanRequest) -> Plan:
    """The plan for `request.strategy`. `request.cost_cluster` (a costmodel.Cluster) is what the
    cost model plans for: the shard count of every sparse PS variable, and routes where a
    strategy asks it (default: num_hosts hosts at the cost model's defaults); `partitions`
    forces that count."""
    chosen = strategy_lib.get(request.strategy)
    capture, num_ranks, num_hosts, partitions = request.capture, request.num_ranks, request.num_hosts, \
        request.partitions
    if partitions is not None and partitions < 1:
        raise ConfigError(f"--partitions must be >= 1, got {partitions}")
    if capture.dynamic_tables and not chosen.carries_dynamic_tables:
        able = [n for n in strategy_lib.names() if strategy_lib.get(n).carries_dynamic_tables]
        raise ConfigError(f"--strategy={request.strategy} cannot train dynamic tables "
                          f"({', '.join(t['name'] for t in capture.dynamic_tables)}); use one of {', '.join(able)}")
    if capture.traced and not chosen.trains_traced_steps:
        able = [n for n in strategy_lib.names() if strategy_lib.get(n).trains_traced_steps]
        raise ConfigError(f"--strategy={request.strategy} cannot train {capture.dialect} yet (it rewrites a model_fn's "
                          f"graph in its own way); use one of {', '.join(able)}, or write the model as a model_fn")
    decided = chosen.decide(request)
    if decided.plan is not None:        # the rule chose another strategy's whole plan
        return decided.plan
    counts = decided.partitions if decided.partitions is not None else \
        _modelled_partitions(request, {name: route for name, (route, _) in decided.routes.items()})
    server_load = [0] * num_hosts
    entries = []
    for info in capture.variables:
        route_name, reason = decided.routes[info.name]
        entry = VariablePlan(name=info.name, shape=info.shape, dtype=info.dtype, bytes=info.bytes,
                             gradient=info.gradient, layer=info.layer, route=route_name, reason=reason,
                             bytes_per_step=0, user_partitioned=info.user_partitioned,
                             params=dict(decided.params.get(info.name, {})))
        _keep_each_row(entry, info)
        route = route_lib.get(entry.route)
        count = (partitions, "--partitions") if partitions is not None else counts.get(info.name, (1, ""))
        if route.on_servers:
            shard(entry, info, count, num_hosts, server_load)
        route.place(entry, info, request, server_load)
        ranks = len(entry.params.get("ranks", range(num_ranks)))
        entry.bytes_per_step = route.bytes_per_step(entry, info, ranks, request)
        entries.append(entry)
    _assign_fusion_groups([e for e in entries if route_lib.get(e.route).fused and e.gradient == "dense"])
    entries.extend(_model_state(capture, decided))
    return Plan(strategy=request.strategy, num_ranks=num_ranks, num_hosts=num_hosts, servers=[],
                local_aggregation=request.local_aggregation, variables=entries, global_step=capture.global_step,
                section=decided.section, options=dataclasses.asdict(request.options),
                dynamic_tables=_dynamic_tables(request, decided), inputs=list(capture.inputs))


def _dynamic_tables(request: PlanRequest, decided: Decisions) -> List[DynamicTablePlan]:
    """Each dynamic table's plan: on the servers (--partitions shards, default one per host), or
    replicated on the ranks where --dynamic_tables or the rule says so."""
    out = []
    for table in request.capture.dynamic_tables:
        route, reason = decided.dynamic_routes.get(table["name"], (DYNAMIC_ON_SERVERS, ""))
        if request.dynamic_tables is not None:
            route, reason = request.dynamic_tables, "--dynamic_tables"
        if route == DYNAMIC_REPLICATED and not table.get("compiles", True):
            raise ConfigError(f"--dynamic_tables=replicated: table {table['name']!r} cannot be replicated (only a "
                              "float32 table with a uniform or constant law can, not normal); "
                              "use --dynamic_tables=servers")
        shards = 1 if route == DYNAMIC_REPLICATED else request.partitions or request.num_hosts
        out.append(DynamicTablePlan(**{**table, "shards": shards, "route": route, "reason": reason}))
    return out


def _keep_each_row(entry, info) -> None:
    """A sparse variable whose apply takes repeated rows one by one: its route is asked to keep
    them so; one that sums them per id first (which would change what the apply computes) gives
    way to AllReduce's allgather, which keeps them."""
    if not info.rows_each or info.gradient != "sparse" or route_lib.get(entry.route).keeps_each_row(entry):
        return
    entry.reason = (f"{entry.reason}; but its optimizer takes a sparse gradient's rows one by one (repeated ids "
                    f"too), which the {entry.route} route sums per id first: allgathered instead")
    entry.route = ROUTE_ALLREDUCE


def _model_state(capture: Capture, decided: Decisions) -> List[VariablePlan]:
    """Model state is not trained: each rank keeps a copy, combined over ranks when read."""
    entries = []
    for state in capture.state:
        how = ("updated from each rank's batch: each rank keeps its own, the mean over ranks is read"
               if state.per_rank else "the same on every rank: rank 0's copy is read")
        if not decided.ranks_meet:     # no point where all ranks could average it
            how = "each rank keeps its own (ranks run asynchronously): rank 0's copy is read"
        params = {"combine": "mean" if state.per_rank and decided.ranks_meet and state.dtype.startswith(
            ("float", "bfloat", "half", "double")) else "rank0"}
        if state.name in decided.state:     # kept by some ranks only
            params["ranks"], where = decided.state[state.name]
            how += f"; {where}"
        entries.append(VariablePlan(name=state.name, shape=state.shape, dtype=state.dtype, bytes=state.bytes,
                                    gradient="none", layer=state.layer, route=ROUTE_LOCAL,
                                    reason=f"model state, not trained: {how}", bytes_per_step=0, params=params))
    return entries


def measurements(strategy: str) -> dict:
    """What capture must measure for the planner to plan `strategy` (keyword arguments)."""
    chosen = strategy_lib.get(strategy)
    return {"time_compute": chosen.time_compute, "measures": chosen.measures}


def shard(entry: VariablePlan, info: VariableInfo, count, num_hosts, load) -> None:
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


def _partition_count(info: VariableInfo, count, entry) -> int:
    """`count`: (shards wanted, who wants them)."""
    wanted, by = count
    rows = info.shape[0] if info.shape else 1
    if info.gradient != "sparse" or rows < 2:
        return 1
    if info.split_refusal:
        if wanted > 1:
            entry.reason += f"; not partitioned: {info.split_refusal}"
        return 1
    if by:
        entry.reason += f"; {min(wanted, rows)} partition(s) ({by})"
    return min(wanted, rows)


def _modelled_partitions(request: PlanRequest, routes: dict) -> dict:
    """Shard count of each sparse PS variable: the one with the shortest predicted step on
    `cluster` (costmodel.choose with the routes fixed), with why."""
    from parallax_tf import costmodel
    capture = request.capture
    # every route on the parameter servers is priced as the PS route
    as_ps = {name: ROUTE_PS if route_lib.get(route).on_servers else route for name, route in routes.items()}
    if not any(r == ROUTE_PS and i.gradient == "sparse" for i in capture.variables for r in [as_ps[i.name]]):
        return {}
    cluster = request.cost_cluster or costmodel.Cluster(request.num_hosts,
                                                        max(1, -(-request.num_ranks // request.num_hosts)))
    loads = request.loads
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


def _assign_fusion_groups(entries: List[VariablePlan]) -> None:
    group, filled = 0, 0
    for entry in entries:
        if filled and filled + entry.bytes > FUSION_BYTES:
            group, filled = group + 1, 0
        entry.fusion_group = group
        filled += entry.bytes
