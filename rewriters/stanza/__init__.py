"""Stanza (Wu et al., arXiv 1812.10624): layer separation. The last ranks (FC nodes) train the
fully connected head on the activations the others (conv nodes) send them.

  measure.py  inspection: where the head begins (cut.py finds the cut), timed
  cost.py     the cost model's prediction of a Stanza step (also weighed by auto)
  plan.py     the rule: FC nodes, groups, sends, every variable's route
  rewrite.py  the two sides' graphs;  runner.py  conv nodes read data shards, FC nodes none
"""
import dataclasses

from parallax_tf import strategy
from rewriters.stanza import cost, plan
from rewriters.stanza.measure import HeadMeasure
from rewriters.stanza.rewrite import rewrite
from rewriters.stanza.split import LayerSplit


@dataclasses.dataclass
class StanzaOptions:
    fc_nodes: int = strategy.option(1, "fc_nodes", "stanza: how many of the last ranks train the FC head (FC nodes).")
    microbatches: int = strategy.option(1, "stanza_microbatches", "stanza: each conv node's batch crosses to its FC "
                                        "node in this many pieces, so FC round trips overlap conv work.")
    sends: str = strategy.option("auto", "stanza_sends", "stanza: a group's conv nodes send their activations to its "
                                 "FC node (and get their gradients back) all at once, or one after another; auto: "
                                 "staggered where together they would overflow the FC node's port (TCP incast).",
                                 choices=("auto", "together", "staggered"))


class Stanza(strategy.Strategy):
    name = "stanza"
    Options = StanzaOptions
    time_compute = True             # whether to stagger sends: the batch's size, timed with the head
    measures = (HeadMeasure(),)
    batch_joined = True             # the FC node's loss is over its conv nodes' batches
    Section = LayerSplit

    def decide(self, request):
        return plan.decide(request)

    def offer(self, request, data_parallel_s):
        return cost.offer(request, data_parallel_s, request.options_of(self.name))

    def rewrite(self, request):
        return rewrite(request)
