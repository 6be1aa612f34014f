"""Routing rules more than one technique uses."""
from parallax_tf.plan import ROUTE_ALLREDUCE, ROUTE_PS


def by_gradient(info):
    """Parallax's rule: (route, why) of one variable by its gradient."""
    if info.gradient == "sparse":
        return ROUTE_PS, ("sparse gradient (IndexedSlices): a PS moves only touched rows, "
                          "allgather would grow with the number of ranks")
    if info.gradient == "none":
        return ROUTE_ALLREDUCE, "no gradient reaches it from the loss: replicated, never updated"
    return ROUTE_ALLREDUCE, "dense gradient: ring AllReduce moves 2(N-1)/N of it with no hotspot"
