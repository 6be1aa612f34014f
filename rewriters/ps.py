"""Strategy `ps`: Every variable on parameter servers (sharded, synchronous, local aggregation)."""
from parallax_tf.plan import ROUTE_ALLREDUCE, ROUTE_PS  # noqa: F401
from rewriters.common import BuildRequest, DistributedGraph
from rewriters.sync import assemble


def rewrite(request: BuildRequest) -> DistributedGraph:
    return assemble(request, (ROUTE_PS,), "ps")
