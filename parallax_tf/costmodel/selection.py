"""The per-variable choice --strategy=auto makes with the predictions (no relaunching, unlike
the Parallax paper's partition search), and the loads it weighs, from an inspected model."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from parallax_tf.costmodel.cluster import Cluster
from parallax_tf.costmodel.prediction import predict
from parallax_tf.costmodel.traffic import Choice, Load
from parallax_tf.plan import ROUTE_ALLREDUCE, ROUTE_ALLTOALL, ROUTE_PS


def candidates(load: Load, cluster: Cluster) -> List[Choice]:
    """AllReduce, or for a sparse variable the PS in a few shard counts and (one variable per
    table) the alltoall route. A dense one stays on
    AllReduce (the Parallax rule): the ring moves the fewest bytes there is, 2(N-1)/N of it,
    where a PS adds a hot server (its 1 shard; the planner partitions only sparse variables).
    Measured on the rig, cnn at 1 Gbit with its dense weights on the PS: 0.69x hybrid on 2
    hosts, 0.38x on 8, its CPU per rank 1.6-2.4x, its pulls not hidden behind other work."""
    options = [Choice(ROUTE_ALLREDUCE)]
    if load.dynamic:        # replicated (AllReduce's allgather prices it), or one shard per host
        return options + [Choice(ROUTE_PS, cluster.hosts)]
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


DYNAMIC_ROWS = 2 ** 40      # a dynamic table has no vocabulary: its rows never bound what moves


def table_loads(capture) -> List[Load]:
    """The dynamic tables that could be replicated, as loads (named `dynamic table <name>`) whose
    AllReduce route prices the replicated route (every rank's push allgathered: its ids, and per id
    the gradient row and the occurrences) and whose PS route the servers; tables whose ids per
    step inspection did not measure are left out (they stay on the servers)."""
    out = []
    for table in capture.dynamic_tables:
        ids = table.get("ids_per_step")
        if not table.get("compiles", False) or not ids:
            continue
        row_bytes = 4 * int(table["dim"])
        out.append(Load(name=table_load_name(table["name"]), bytes=ids * row_bytes, gradient="sparse",
                        row_bytes=row_bytes, rows=DYNAMIC_ROWS, rows_touched=ids,
                        gathered_bytes=ids * (row_bytes + 4), dynamic=True))
    return out


def table_load_name(table: str) -> str:
    return f"dynamic table {table}"
