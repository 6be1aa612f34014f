"""Parallax (Kim et al., EuroSys 2019) and its two baselines: strategies `hybrid` (sparse variables
on parameter servers, dense ones through Horovod AllReduce), `ps`, `allreduce`, and `auto` (the
cost model picks PS or AllReduce, and a shard count, per variable). All four are synchronous data
parallelism: rewriters/shared/sync.py assembles the step from the PS and AllReduce routes; the
rule of `auto` is in auto.py."""
from parallax_tf import strategy
from parallax_tf.plan import ROUTE_ALLREDUCE, ROUTE_PS
from rewriters.shared.rules import by_gradient
from rewriters.shared.sync import assemble


class Hybrid(strategy.Strategy):
    name = "hybrid"
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

