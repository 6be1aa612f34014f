"""PS+ (IEEE TPDS 33(12), 2022): asynchronous parameter servers, eager pull, staleness-scaled
learning rate. Every variable is on route async_ps.

  options.py  its flags;  rewrite.py  the servers' state, the push and the pulls;
  runner.py   the trainer, pusher and puller threads of a rank
"""
from parallax_tf import strategy
from parallax_tf.plan import ROUTE_ASYNC_PS, Shard
from rewriters.ps_plus.options import PSPlusOptions
from rewriters.ps_plus.rewrite import rewrite


class PSPlus(strategy.Strategy):
    name = "ps_plus"
    Options = PSPlusOptions
    time_compute = True      # the cost model picks each sparse variable's shard count

    def check(self, options):
        options.check()

    def decide(self, request):
        routes = {}
        for info in request.capture.variables:
            routes[info.name] = (ROUTE_ASYNC_PS, (
                "strategy ps_plus, sparse gradient: on the PS, its rows read in the step; each push applied as it "
                "arrives, lr scaled by staleness") if info.gradient == "sparse" else (
                "strategy ps_plus: global copy on the PS, pulled eagerly into a local copy; each push applied as it "
                "arrives, lr scaled by staleness"))
        return strategy.Decisions(routes, ranks_meet=False)

    def place(self, entry, info, request, server_load):
        async_copies(entry, request.options.sparse_pull)      # the planner sharded it

    def rewrite(self, request):
        return rewrite(request)


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
