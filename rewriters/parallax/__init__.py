"""Parallax (Kim et al., EuroSys 2019) and its baselines: strategies `hybrid` (sparse variables
on parameter servers, dense ones through Horovod AllReduce), `ps`, `allreduce`, `collective`
(sparse variables sharded over the ranks and exchanged by alltoall, as Sparse Operation Kit
does; dense ones AllReduce) and `auto` (the cost model picks a route, and a shard count, per
variable). All are synchronous data parallelism: rewriters/shared/sync.py assembles the step
from the routes; the rule of `auto` is in auto.py."""
from parallax_tf import strategy
from parallax_tf.plan import ROUTE_ALLREDUCE, ROUTE_ALLTOALL, ROUTE_PS
from rewriters.shared.rules import by_gradient
from rewriters.shared.sync import assemble


class Hybrid(strategy.Strategy):
    name = "hybrid"
    carries_dynamic_tables = True
    trains_traced_steps = True
    time_compute = True      # the cost model picks each sparse variable's shard count
    routes = (ROUTE_PS, ROUTE_ALLREDUCE)

    def decide(self, request):
        return strategy.Decisions({info.name: self.route(info) for info in request.capture.variables})

    def route(self, info):
        return by_gradient(info)

    def rewrite(self, request):
        return assemble(request, self.routes, self.name)


class PS(Hybrid):
    name = "ps"
    routes = (ROUTE_PS,)

    def route(self, info):
        return ROUTE_PS, "strategy ps: every variable on parameter servers"


class AllReduce(Hybrid):
    name = "allreduce"
    time_compute = False
    routes = (ROUTE_ALLREDUCE,)

    def route(self, info):
        how = "allgather of IndexedSlices" if info.gradient == "sparse" else "ring AllReduce"
        return ROUTE_ALLREDUCE, f"strategy allreduce: {how}"


class Collective(Hybrid):
    name = "collective"
    time_compute = False
    routes = (ROUTE_ALLTOALL, ROUTE_ALLREDUCE)

    def route(self, info):
        if info.gradient == "sparse" and not info.user_partitioned:
            return ROUTE_ALLTOALL, ("sparse gradient, strategy collective: rows sharded over the ranks, ids and rows "
                                    "exchanged by alltoall (no PS)")
        if info.gradient == "sparse":
            return ROUTE_ALLREDUCE, ("sparse gradient, but partitioned by the model: allgather (the alltoall route "
                                     "holds one variable per table)")
        return by_gradient(info)
