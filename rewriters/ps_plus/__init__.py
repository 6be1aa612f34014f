"""PS+ (IEEE TPDS 33(12), 2022): asynchronous parameter servers, eager pull, staleness-scaled
learning rate. Every variable is on route async_ps.

  options.py  its flags;  rewrite.py  the servers' state, the push and the pulls;
  runner.py   the trainer, pusher and puller threads of a rank
"""
from parallax_tf import strategy
from rewriters.ps_plus.options import PSPlusOptions
from rewriters.ps_plus.rewrite import rewrite
from rewriters.ps_plus.route import ROUTE_ASYNC_PS


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

    def rewrite(self, request):
        return rewrite(request)
