"""Routes: how a variable's value and gradient travel between ranks, each describing itself.

A route tells the planner where a variable goes (on the parameter servers, sharded by rows, or a
layout of its own), what one rank moves for it per step, what the plan's table shows of its
shards, and the synchronous step how to build it (`sync_route`). The core's routes are here; a technique registers
its own from its package (`register`), and the planner and the plan ask the route, never its
name. `python -c "import parallax_tf; from parallax_tf import routes; print(routes.describe())"`
lists them.
"""
from __future__ import annotations

from typing import Dict, Tuple


class Route:
    """One route. Subclasses override what differs from a replicated, AllReduced variable."""
    name: str = ""
    summary: str = ""          # one line: what the route does (routes.describe)
    on_servers: bool = False   # its value lives on the parameter servers, sharded by rows by the planner
    trained: bool = True       # False: model state, updated by the model's own ops
    fused: bool = False        # dense tensors go through Horovod's fused AllReduce (fusion groups)
    # How the synchronous step builds it: a factory (request, rebuilt, entries) -> its SyncRoute
    # (rewriters/shared/pipeline.py). None: the step builds it itself (PS, AllReduce) or cannot.
    sync_route = None

    def place(self, entry, info, request, server_load) -> None:
        """Lays the variable out beyond the planner's row sharding (shards, copies, params)."""

    def bytes_per_step(self, entry, info, num_ranks: int, request) -> int:
        """Bytes one of the `num_ranks` ranks sharing it sends plus receives for it in one step
        (plan-time estimate): on servers, a push of the gradient and a pull of the value;
        replicated, a ring AllReduce (dense) or an allgather of the touched rows (sparse)."""
        if num_ranks <= 1 or info.gradient == "none":
            return 0
        if info.gradient == "sparse":
            rows = info.rows_touched if info.rows_touched is not None else info.shape[0]
            touched = rows * (info.row_bytes + 8)            # values + int64 index
            if self.on_servers:
                return 2 * touched - rows * 8                # push grad rows, pull rows
            return (num_ranks - 1) * touched                 # allgather: everyone's rows arrive
        if self.on_servers:
            return 2 * info.bytes                            # push gradient, pull variable
        return int(2 * (num_ranks - 1) / num_ranks * info.bytes)

    def shards_cell(self, entry) -> str:
        """The plan table's "shards" cell for a variable on this route."""
        return "-"

    def keeps_each_row(self, entry) -> bool:
        """Whether the route can hand a sparse variable's apply every rank's rows one by one,
        repeated ids included (its params say so where that is not how it carries them)."""
        return True


class ParameterServers(Route):
    name = "ps"
    summary = ("sharded over parameter servers, synchronous aggregation (Parallax): each step pushes the "
               "gradient (its touched rows) and pulls the value")
    on_servers = True

    def shards_cell(self, entry) -> str:
        return str(entry.partitions) + (" (user)" if entry.user_partitioned else "")

    def keeps_each_row(self, entry) -> bool:
        entry.params["rows"] = "each"          # gathered to rank 0, not summed in an accumulator
        return True


class AllReduce(Route):
    name = "allreduce"
    summary = "replicated on every rank, gradients averaged by Horovod (allgather for IndexedSlices)"
    fused = True


class Alltoall(Route):
    name = "alltoall"
    summary = ("row-sharded over the data ranks (row i on rank i % N, no PS): each step a lookup's distinct ids go "
               "to their owners and their rows come back by Horovod alltoall, the gradient rows return the same way "
               "and each owner applies them")

    def place(self, entry, info, request, server_load):
        entry.layout = RANKS_LAYOUT
        entry.params["rank_shards"] = request.num_ranks

    def bytes_per_step(self, entry, info, num_ranks, request):
        if num_ranks <= 1 or info.gradient == "none":
            return 0
        rows = info.rows_touched if info.rows_touched is not None else info.shape[0]
        # the ids sent once, their rows back, the gradient rows out; 1/N of them stay on the rank
        return int((num_ranks - 1) / num_ranks * rows * (2 * info.row_bytes + 8))

    def shards_cell(self, entry):
        return f"{entry.params.get('rank_shards', '?')} ranks"

    def keeps_each_row(self, entry) -> bool:
        return False                            # owners sum the rows of one id


# Layout of a variable held by the ranks themselves: row i on rank i % N (the number of ranks).
RANKS_LAYOUT = "ranks"


class Local(Route):
    name = "local"
    summary = ("model state that is not trained (batch-norm statistics, EMAs, counters): a copy on every rank, "
               "updated by the model's own ops; params['combine'] says how copies combine when read")
    trained = False

    def shards_cell(self, entry) -> str:
        return "mean" if entry.params.get("combine") == "mean" else "-"


_REGISTRY: Dict[str, Route] = {}


def register(route: Route) -> Route:
    if route.name in _REGISTRY and type(_REGISTRY[route.name]) is not type(route):
        raise ValueError(f"route {route.name!r} registered twice")
    _REGISTRY[route.name] = route
    return route


def build_with(name: str, sync_route) -> None:
    """A technique's package gives the synchronous step's builder of a core route, which the core
    cannot import (layers point one way): the alltoall route's is rewriters/shared/alltoall_route.py's."""
    get(name).sync_route = sync_route


def get(name: str) -> Route:
    if name not in _REGISTRY:
        raise ValueError(f"unknown route {name!r}; registered: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def names() -> Tuple[str, ...]:
    return tuple(_REGISTRY)


def describe() -> str:
    return "\n".join(f"{route.name:<12} {route.summary}" for route in _REGISTRY.values())


PS = register(ParameterServers())
ALLREDUCE = register(AllReduce())
LOCAL = register(Local())
ALLTOALL = register(Alltoall())
