"""A strategy written outside the toolkit, as a user or a new technique would: every variable on
AllReduce (sparse gradients allgathered), planned by its own rule and built by the shared
synchronous pipeline. It touches no file of parallax_tf/ or rewriters/: one class, one
`strategy.register` call. tests/test_toy_strategy.py trains it and checks it exactly."""
from parallax_tf import strategy
from parallax_tf.plan import ROUTE_ALLREDUCE
from rewriters.shared.sync import assemble

NAME = "toy_everything_allreduced"


class EverythingAllReduced(strategy.Strategy):
    name = NAME

    def decide(self, request):
        return strategy.Decisions({info.name: (ROUTE_ALLREDUCE, "toy rule: every variable replicated")
                                   for info in request.capture.variables})

    def rewrite(self, request):
        return assemble(request, (ROUTE_ALLREDUCE,), self.name)


def register() -> strategy.Strategy:
    return strategy.register(EverythingAllReduced())
