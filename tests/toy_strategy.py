"""Strategies written outside the toolkit, as a user or a new technique would, planned by their
own rule and built by the shared synchronous pipeline: every variable on AllReduce (sparse
gradients allgathered); and the sparse variables split between the PS and the alltoall route,
in turn by name. They touch no file of parallax_tf/ or rewriters/: one class, one
`strategy.register` call each. tests/test_toy_strategy.py trains them and checks them exactly."""
from parallax_tf import strategy
from parallax_tf.plan import ROUTE_ALLREDUCE, ROUTE_ALLTOALL, ROUTE_PS
from rewriters.shared.sync import assemble

NAME = "toy_everything_allreduced"
SPLIT_NAME = "toy_tables_split"


class EverythingAllReduced(strategy.Strategy):
    name = NAME

    def decide(self, request):
        return strategy.Decisions({info.name: (ROUTE_ALLREDUCE, "toy rule: every variable replicated")
                                   for info in request.capture.variables})

    def rewrite(self, request):
        return assemble(request, (ROUTE_ALLREDUCE,), self.name)


class TablesSplit(strategy.Strategy):
    name = SPLIT_NAME

    def decide(self, request):
        sparse = sorted(info.name for info in request.capture.variables if info.gradient == "sparse")
        routes = {name: (ROUTE_PS, ROUTE_ALLTOALL)[sparse.index(name) % 2] if name in sparse else ROUTE_ALLREDUCE
                  for name in (info.name for info in request.capture.variables)}
        return strategy.Decisions({name: (route, "toy rule: sparse tables in turn on the PS and on alltoall")
                                   for name, route in routes.items()})

    def rewrite(self, request):
        return assemble(request, (ROUTE_PS, ROUTE_ALLREDUCE, ROUTE_ALLTOALL), self.name)


def register() -> None:
    strategy.register(EverythingAllReduced())
    strategy.register(TablesSplit())
