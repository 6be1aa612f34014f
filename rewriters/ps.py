"""Strategy `ps`: every variable on parameter servers (sharded, synchronous, local aggregation)."""
from parallax_tf.plan import ROUTE_PS
from rewriters.common import BuildRequest, DistributedGraph
from rewriters.sync import assemble


def rewrite(request: BuildRequest) -> DistributedGraph:
    return assemble(request, (ROUTE_PS,), "ps")
