"""Strategy `allreduce`: every variable replicated; Horovod AllReduce for dense gradients, allgather for IndexedSlices."""
from parallax_tf.plan import ROUTE_ALLREDUCE
from rewriters.common import BuildRequest, DistributedGraph
from rewriters.sync import assemble


def rewrite(request: BuildRequest) -> DistributedGraph:
    return assemble(request, (ROUTE_ALLREDUCE,), "allreduce")
