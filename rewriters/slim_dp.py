"""Strategy `slim_dp` (Slim-DP, arXiv 1709.09393): dense variables on the significant route
(local replicas; per round only the significant + explored coordinates synchronised through
the PS), sparse variables on the hybrid PS route."""
from parallax_tf.plan import ROUTE_ALLREDUCE, ROUTE_PS, ROUTE_SIGNIFICANT
from rewriters.common import BuildRequest, DistributedGraph
from rewriters.significant_route import SignificantRoute
from rewriters.sync import assemble


def rewrite(request: BuildRequest) -> DistributedGraph:
    return assemble(request, (ROUTE_PS, ROUTE_ALLREDUCE), "slim_dp", {ROUTE_SIGNIFICANT: SignificantRoute})
