"""The techniques, one package each, and the one list that registers them (parallax_tf.strategy).

  parallax/  hybrid, ps, allreduce, auto (synchronous; PS and AllReduce routes)
  slim_dp/   Slim-DP's significant route;  ps_plus/  asynchronous PS;  stanza/  layer separation
  dsp/       pipeline stages with layer-wise staleness
  shared/    graph machinery every technique uses (rebuild, transform, pruning, copy, exchange)
"""
from parallax_tf import flags, strategy
from rewriters.dsp import DSP
from rewriters.parallax import AllReduce, Hybrid, PS
from rewriters.parallax.auto import Auto
from rewriters.ps_plus import PSPlus
from rewriters.slim_dp import SlimDP
from rewriters.stanza import Stanza

STRATEGIES = (Hybrid(), PS(), AllReduce(), Auto(), SlimDP(), PSPlus(), Stanza(), DSP())
for _strategy in STRATEGIES:
    strategy.register(_strategy)
flags.define_strategy_flag()
