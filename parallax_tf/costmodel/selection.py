"""The per-variable choice --strategy=auto makes with the predictions (no relaunching, unlike
the Parallax paper's partition search), and the loads it weighs, from an inspected model."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

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
# the share of a rank's part of its host's memory that all its copies of replicated tables may
# take, at most: auto replicates a table only where its largest possible copy still fits
REPLICA_MEMORY_SHARE = 0.25
TRACKED_ID_BYTES = 32       # what a shard keeps per id besides row and slots: counts, last seen, the map's


def replica_bytes(table: dict, steps: Optional[int], ranks: int) -> Optional[int]:
    """The most one rank's copy of a dynamic table can hold, in bytes: the rows its capacity
    allows, else the rows it holds at the start plus every id `steps` steps of `ranks` ranks can
    add (None: neither bounds it). Per row its values and slots (float32) and what an id keeps;
    ids waiting for admission are bounded by as many again."""
    rows = table.get("capacity")
    if rows is None:
        if not steps or not table.get("ids_per_step"):
            return None
        rows = table.get("rows_at_start", 0) + steps * ranks * table["ids_per_step"]
    waiting = rows if table.get("admit_after", 1) > 1 else 0
    return rows * (4 * int(table["dim"]) * (1 + table.get("slots", 0)) + TRACKED_ID_BYTES) + \
        waiting * TRACKED_ID_BYTES


def table_loads(capture, cluster: Cluster, steps: Optional[int]) -> Tuple[List[Load], Dict[str, str]]:
    """The dynamic tables auto may replicate, as loads (named `dynamic table <name>`) whose
    AllReduce route prices the replicated route (every rank's push allgathered: its ids, and per
    id the gradient row and the occurrences) and whose PS route the servers; and, for every other
    table, why it stays on the servers. Copies must fit REPLICA_MEMORY_SHARE of a rank's memory
    together: the smallest tables first."""
    budget = cluster.memory_bytes / cluster.ranks_per_host * REPLICA_MEMORY_SHARE if cluster.memory_bytes else None
    loads, left, used = [], {}, 0
    sizes = {t["name"]: replica_bytes(t, steps, cluster.ranks) for t in capture.dynamic_tables}
    for table in sorted(capture.dynamic_tables, key=lambda t: (sizes[t["name"]] is None, sizes[t["name"]] or 0)):
        name, ids, size = table["name"], table.get("ids_per_step"), sizes[table["name"]]
        if not table.get("compiles", False):
            left[name] = "cannot be replicated: not float32, or its initial law does not compile"
        elif not ids:
            left[name] = "its ids per step were not measured"
        elif size is None:
            left[name] = "nothing bounds a copy's rows (no capacity, steps unknown)"
        elif budget is not None and used + size > budget:
            left[name] = (f"a copy could reach {size / 2**20:,.0f} MB, past what a rank gives copies "
                          f"({budget / 2**20:,.0f} MB: a quarter of its share of the host's memory)")
        else:
            used += size
            row_bytes = 4 * int(table["dim"])
            loads.append(Load(name=table_load_name(name), bytes=ids * row_bytes, gradient="sparse",
                              row_bytes=row_bytes, rows=DYNAMIC_ROWS, rows_touched=ids,
                              gathered_bytes=ids * (row_bytes + 4), dynamic=True))
    return loads, left


def table_load_name(table: str) -> str:
    return f"dynamic table {table}"
