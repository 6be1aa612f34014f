"""Strategy `auto`: the cost model (parallax_tf/costmodel.py) picks PS or AllReduce and a shard
count per variable for the cluster it plans for; the result is a hybrid plan. With --auto_stanza
it plans Stanza instead where the cost model predicts a batch 5% or more faster that way."""
from __future__ import annotations

import dataclasses

from parallax_tf import costmodel, planner, strategy
from parallax_tf.errors import ConfigError
from parallax_tf.plan import DYNAMIC_ON_SERVERS, DYNAMIC_REPLICATED, ROUTE_ALLREDUCE, ROUTE_ALLTOALL, ROUTE_PS
from rewriters.shared.sync import assemble


@dataclasses.dataclass
class AutoOptions:
    stanza: bool = strategy.option(False, "auto_stanza", "auto may choose stanza when the cost model predicts it "
                                   "faster; its FC nodes read no data, so a step then trains on fewer batches (one "
                                   "per conv node).")


class Auto(strategy.Strategy):
    carries_dynamic_tables = True
    trains_traced_steps = True
    name = "auto"
    Options = AutoOptions
    time_compute = True
    ALTERNATIVE = "stanza"      # the whole-plan strategy --auto_stanza lets it choose

    @property
    def measures(self):         # what the alternative needs measured (the FC head, timed)
        return strategy.get(self.ALTERNATIVE).measures

    def decide(self, request):
        if request.cost_cluster is None:
            raise ConfigError("--strategy=auto needs the cluster it plans for (hosts, link bandwidth)")
        auto, per_variable, tables = _choices(request)
        offer = strategy.get(self.ALTERNATIVE).offer(request, per_variable)
        if offer is not None and request.options.stanza:     # the cost model prefers the alternative
            plan = planner.make_plan(dataclasses.replace(request, strategy=self.ALTERNATIVE, options=offer.options))
            for entry in plan.variables:
                entry.reason = f"auto chose {self.ALTERNATIVE} ({offer.why}; one batch per conv node): {entry.reason}"
            return strategy.Decisions({}, plan=plan)
        if offer is not None:       # say so, and keep the batch the user chose
            ranks = request.num_ranks
            auto = {name: (choice, f"{reason}; {self.ALTERNATIVE} predicted faster per batch ({offer.why}) but not "
                                   f"chosen: its FC node(s) read no data, so a step would train on "
                                   f"{_batches(offer.batches)} instead of {ranks} (--auto_stanza allows it)")
                    for name, (choice, reason) in auto.items()}
        return strategy.Decisions({name: (choice.route, reason) for name, (choice, reason) in auto.items()},
                                  partitions={name: (choice.partitions, "the cost model")
                                              for name, (choice, _) in auto.items()},
                                  dynamic_routes=tables)

    def rewrite(self, request):
        return assemble(request, (ROUTE_PS, ROUTE_ALLREDUCE, ROUTE_ALLTOALL), self.name)


def _choices(request):
    """Route and shard count per variable from the cost model, each with its reason; the
    predicted step time of them all; each dynamic table's route with its reason (the servers,
    or replicated where the cost model prices that faster)."""
    cluster = request.cost_cluster
    if request.partitions is not None:      # the count it asked for shards the tables over the servers
        tables, left = [], {t["name"]: f"--partitions={request.partitions}" for t in request.capture.dynamic_tables}
    else:
        tables, left = costmodel.table_loads(request.capture, cluster, request.steps)
    loads = request.loads + tables
    compute = request.capture.compute_s or 0.0
    choices = costmodel.choose(loads, cluster, compute)
    step = costmodel.predict(loads, choices, cluster, compute).step_s
    out = {}
    for load in request.loads:
        choice = choices[load.name]
        alternatives = ", ".join(
            f"{c.route}{'x' + str(c.partitions) if c.route == ROUTE_PS else ''} "
            f"{costmodel.predict(loads, {**choices, load.name: c}, cluster, compute).step_s * 1000:.1f}ms"
            for c in costmodel.candidates(load, cluster) if c != choice)
        out[load.name] = (choice, f"cost model: predicted step {step * 1000:.1f}ms"
                                  + (f"; instead: {alternatives}" if alternatives else
                                     f"; the only candidate for a {load.gradient} gradient (AllReduce's ring "
                                     "moves the fewest bytes)"))
    return out, step, _table_routes(request, loads, choices, step, left)


def _table_routes(request, loads, choices, step, left):
    """Table -> (route, why) for each dynamic table: replicated where the cost model chose the
    allgather of its pushes (its AllReduce route), else the servers (`left`: why a table was not
    priced)."""
    cluster, compute = request.cost_cluster, request.capture.compute_s or 0.0
    routes = {}
    for table in request.capture.dynamic_tables:
        name = costmodel.table_load_name(table["name"])
        if name not in choices:
            routes[table["name"]] = (DYNAMIC_ON_SERVERS, left[table["name"]])
            continue
        replicated = choices[name].route == ROUTE_ALLREDUCE
        other = costmodel.Choice(ROUTE_PS, cluster.hosts) if replicated else costmodel.Choice(ROUTE_ALLREDUCE)
        instead = costmodel.predict(loads, {**choices, name: other}, cluster, compute).step_s
        routes[table["name"]] = (DYNAMIC_REPLICATED if replicated else DYNAMIC_ON_SERVERS,
                                 f"cost model: predicted step {step * 1000:.1f}ms; "
                                 f"{'on the servers' if replicated else 'replicated'} {instead * 1000:.1f}ms")
    return routes


def _batches(n: int) -> str:
    return f"{n} batch" if n == 1 else f"{n} batches"
