"""Strategy `hybrid`: Parallax: sparse variables on parameter servers, dense ones through Horovod AllReduce."""
from parallax_tf.plan import ROUTE_ALLREDUCE, ROUTE_PS
from rewriters.common import BuildRequest, DistributedGraph
from rewriters.sync import assemble


def rewrite(request: BuildRequest) -> DistributedGraph:
    return assemble(request, (ROUTE_PS, ROUTE_ALLREDUCE), request.plan.strategy)
