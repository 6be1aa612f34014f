"""Slim-DP (Sun et al., arXiv 1709.09393): dense variables on the significant route (local
replicas; per round only the significant + explored coordinates synchronised through the PS,
route.py), sparse variables on Parallax's PS route."""
import math

from parallax_tf import routes, strategy
from parallax_tf.plan import ROUTE_ALLREDUCE, ROUTE_PS, Shard
from rewriters.shared.rules import by_gradient
from rewriters.shared.sync import assemble
from rewriters.slim_dp.options import SlimOptions
from rewriters.slim_dp.route import SignificantRoute

# A variable with at least this many elements has its global copy split over every server: each
# host's link then carries 1/H of the round's traffic, not all of it on one.
SPLIT_ELEMENTS = 1 << 16


class Significant(routes.Route):
    name = "significant"
    summary = ("Slim-DP: a global copy on the PS (flat, split into shards of elements), a local replica on every "
               "rank; each round only the significant + explored coordinates are pushed, averaged, applied, pulled")
    sync_route = SignificantRoute

    def place(self, entry, info, request, server_load):
        split_elements(entry, info, request.num_hosts, server_load)

    def bytes_per_step(self, entry, info, num_ranks, request):
        if num_ranks <= 1:
            return super().bytes_per_step(entry, info, num_ranks, request)
        options = request.options
        chosen = options.core + options.explore          # push + pull the selected values per round
        return int(2 * chosen * info.bytes / max(1, options.period))

    def shards_cell(self, entry):
        return str(entry.partitions)


ROUTE_SIGNIFICANT = routes.register(Significant()).name


class SlimDP(strategy.Strategy):
    name = "slim_dp"
    Options = SlimOptions

    def check(self, options):
        options.check()

    def decide(self, request):
        routes = {}
        for info in request.capture.variables:
            routes[info.name] = (ROUTE_SIGNIFICANT, (
                "dense gradient, strategy slim_dp: a local replica per rank; each round only the significant "
                "+ explored coordinates are synchronised on the PS")) if info.gradient == "dense" else by_gradient(info)
        return strategy.Decisions(routes)

    def rewrite(self, request):
        return assemble(request, (ROUTE_PS, ROUTE_ALLREDUCE, ROUTE_SIGNIFICANT), self.name)


def split_elements(entry, info, num_hosts: int, load) -> None:
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
