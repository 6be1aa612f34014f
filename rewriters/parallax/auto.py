"""Strategy `auto`: the cost model (parallax_tf/costmodel.py) picks PS or AllReduce and a shard
count per variable for the cluster it plans for; the result is a hybrid plan. With --auto_stanza
it plans Stanza instead where the cost model predicts a batch 5% or more faster that way."""
from __future__ import annotations

import dataclasses

from parallax_tf import costmodel, planner, strategy
from parallax_tf.errors import ConfigError
from parallax_tf.plan import ROUTE_ALLREDUCE, ROUTE_PS
from rewriters.parallax.sync import assemble
from rewriters.stanza import cost as stanza_cost
from rewriters.stanza.measure import HeadMeasure, found_head


@dataclasses.dataclass
class AutoOptions:
    stanza: bool = strategy.option(False, "auto_stanza", "auto may choose stanza when the cost model predicts it "
                                   "faster; its FC nodes read no data, so a step then trains on fewer batches (one "
                                   "per conv node).")


class Auto(strategy.Strategy):
    name = "auto"
    Options = AutoOptions
    time_compute = True
    measures = (HeadMeasure(),)     # the FC head, timed: whether Stanza would be faster

    def decide(self, request):
        if request.cost_cluster is None:
            raise ConfigError("--strategy=auto needs the cluster it plans for (hosts, link bandwidth)")
        auto = _choices(request)
        stanza = _stanza(request, auto)
        if stanza is not None and request.options.stanza:     # the cost model prefers layer separation
            fc_nodes, why = stanza
            options = dataclasses.replace(request.options_of("stanza"), fc_nodes=fc_nodes)
            plan = planner.make_plan(request.capture, "stanza", request.num_ranks, request.num_hosts,
                                     request.partitions, request.local_aggregation, request.cost_cluster, options,
                                     request.all_options)
            for entry in plan.variables:
                entry.reason = f"auto chose stanza ({why}; one batch per conv node): {entry.reason}"
            return strategy.Decisions({}, plan=plan)
        if stanza is not None:       # say so, and keep the batch the user chose
            fc_nodes, why = stanza
            ranks = request.num_ranks
            auto = {name: (choice, f"{reason}; stanza predicted faster per batch ({why}) but not chosen: its FC "
                                   f"node(s) read no data, so a step would train on {_batches(ranks - fc_nodes)} "
                                   f"instead of {ranks} (--auto_stanza allows it)")
                    for name, (choice, reason) in auto.items()}
        return strategy.Decisions({name: (choice.route, reason) for name, (choice, reason) in auto.items()},
                                  partitions={name: (choice.partitions, "the cost model")
                                              for name, (choice, _) in auto.items()})

    def rewrite(self, request):
        return assemble(request, (ROUTE_PS, ROUTE_ALLREDUCE), self.name)


def _choices(request):
    """Route and shard count per variable from the cost model, with the predicted step time."""
    cluster, loads = request.cost_cluster, request.loads
    compute = request.capture.compute_s or 0.0
    choices = costmodel.choose(loads, cluster, compute)
    step = costmodel.predict(loads, choices, cluster, compute).step_s
    out = {}
    for load in loads:
        choice = choices[load.name]
        alternatives = ", ".join(
            f"{c.route}{'x' + str(c.partitions) if c.route == ROUTE_PS else ''} "
            f"{costmodel.predict(loads, {**choices, load.name: c}, cluster, compute).step_s * 1000:.1f}ms"
            for c in costmodel.candidates(load, cluster) if c != choice)
        out[load.name] = (choice, f"cost model: predicted step {step * 1000:.1f}ms"
                                  + (f"; instead: {alternatives}" if alternatives else
                                     f"; the only candidate for a {load.gradient} gradient (AllReduce's ring "
                                     "moves the fewest bytes)"))
    return out


def _batches(n: int) -> str:
    return f"{n} batch" if n == 1 else f"{n} batches"


def _stanza(request, auto: dict):
    """(FC nodes, why) when the cost model predicts Stanza to train a batch 5% or more faster than
    the per-variable plan, else None. (Stanza on 2 ranks is 1 conv node: half the batches a step.)"""
    capture, cluster = request.capture, request.cost_cluster
    split = stanza_cost.layer_split_load(capture)
    if split is None or cluster.ranks < 2:
        return None
    if any(s.name in found_head(capture).head.state for s in capture.state):
        return None                 # batch norm inside the head: no test covers it yet, stay data parallel
    loads = request.loads
    compute = capture.compute_s or 0.0
    per_variable = costmodel.predict(loads, {name: choice for name, (choice, _) in auto.items()}, cluster,
                                     compute).step_s
    fc_nodes, predicted = stanza_cost.choose_fc_nodes(loads, split, cluster, compute)
    ranks = cluster.ranks
    if not stanza_cost.prefers_stanza(predicted.step_s, fc_nodes, per_variable, ranks):
        return None
    return fc_nodes, (f"predicted {stanza_cost.per_batch_s(predicted.step_s, ranks, fc_nodes) * 1000:.1f}ms per batch "
                      f"with {fc_nodes} FC node(s), a {predicted.step_s * 1000:.1f}ms step of "
                      f"{_batches(ranks - fc_nodes)}, vs {stanza_cost.per_batch_s(per_variable, ranks) * 1000:.1f}ms "
                      f"data parallel, a {per_variable * 1000:.1f}ms step of {_batches(ranks)}")
