"""The techniques, one package each, and the one list that registers them (parallax_tf.strategy).

  parallax/  hybrid, ps, allreduce, collective, auto (synchronous; PS, AllReduce and alltoall routes)
  slim_dp/   Slim-DP's significant route;  ps_plus/  asynchronous PS;  stanza/  layer separation
  dsp/       pipeline stages with layer-wise staleness
  shared/    graph machinery every technique uses (rebuild, transform, pruning, copy, exchange) and
             the routes several of them carry (PS, AllReduce, alltoall)
"""
from parallax_tf import flags, strategy
from rewriters.dsp import DSP
from rewriters.parallax import AllReduce, Collective, Hybrid, PS
from rewriters.parallax.auto import Auto
from rewriters.ps_plus import PSPlus
from rewriters.slim_dp import SlimDP
from rewriters.stanza import Stanza

STRATEGIES = (Hybrid(), PS(), AllReduce(), Collective(), Auto(), SlimDP(), PSPlus(), Stanza(), DSP())
for _strategy in STRATEGIES:
    strategy.register(_strategy)
flags.define_strategy_flag()
