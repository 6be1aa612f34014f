"""PS+'s route: the global copy on parameter servers, updated by each push as it arrives with a
staleness-scaled learning rate; dense variables also have a local copy per rank, pulled eagerly
in the background (params["pull"] "eager"), sparse ones are read row by row from the server in
the step (params["pull"] "rows")."""
from parallax_tf import routes
from parallax_tf.plan import Shard


class AsyncParameterServers(routes.ParameterServers):
    name = "async_ps"
    summary = ("PS+: the global copy on parameter servers, each push applied as it arrives with a staleness-scaled "
               "learning rate; dense variables pulled eagerly into a local copy, sparse ones read by rows")

    def place(self, entry, info, request, server_load) -> None:
        async_copies(entry, request.options.sparse_pull)      # the planner sharded it

    def shards_cell(self, entry) -> str:
        return str(entry.partitions)


def async_copies(entry, sparse_pull: str) -> None:
    """A dense async_ps variable (and a sparse one with sparse_pull "eager"): its global copy
    on the server under its own name, the model's variable (single-device name) is the rank's
    local copy, pulled eagerly. A sparse one otherwise: the model's variable itself lives on the
    server and the step reads its rows."""
    rows = entry.gradient == "sparse" and sparse_pull == "rows"
    entry.params["pull"] = "rows" if rows else "eager"
    if not rows and not entry.user_partitioned and len(entry.shards) > 1:
        # the local copy is one variable, so the global copy is one piece too
        first = entry.shards[0]
        entry.shards = [Shard(entry.name, 0, entry.shards[-1].row_end, first.server)]
        entry.reason += "; one piece: it is pulled whole into a local copy"
    if not rows:
        for shard in entry.shards:
            shard.name = f"{shard.name}/parallax_global"


ASYNC_PS = routes.register(AsyncParameterServers())
ROUTE_ASYNC_PS = ASYNC_PS.name
