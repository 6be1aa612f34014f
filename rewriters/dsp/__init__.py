"""DSP (Xu et al., CVPR 2020, arXiv 1909.02625): pipelined model parallelism with layer-wise
staleness.

  measure.py  inspection: cut points and per-op times;  cut.py  finding and balancing cuts
  plan.py     the rule: stages, replicas, every variable's stage
  rewrite.py  a stage's forward/backward graphs;  schedule.py  the ticks, as data;
  runner.py   runs a stage's ticks
"""
import dataclasses
from typing import Optional

from parallax_tf import strategy
from parallax_tf.errors import ConfigError
from rewriters.dsp import plan
from rewriters.dsp.measure import PipelineMeasure
from rewriters.dsp.pipeline import Pipeline
from rewriters.dsp.rewrite import rewrite


@dataclasses.dataclass
class DSPOptions:
    stages: Optional[int] = strategy.option(None, "stages", "dsp: pipeline stages K (default: every rank, one "
                                            "pipeline).", kind="int")
    replicas: int = strategy.option(1, "dsp_replicas", "dsp: pipelines side by side R (ranks = K x R), data "
                                    "parallel across them.")
    cuts: list = strategy.option([], "dsp_cuts", "dsp: the K-1 tensors where stages 1..K-1 begin (default: the "
                                 "planner balances the measured compute).")
    schedule: str = strategy.option("dsp", "dsp_schedule", "dsp: the tick rule with layer-wise staleness; locked: "
                                    "one batch in the pipeline at a time, plain backprop (the baseline DSP removes).",
                                    choices=("dsp", "locked"))
    grad_scale: float = strategy.option(1.0, "dsp_grad_scale", "dsp: factor on the gradient of every stage but the "
                                        "last (stale ones).")


class DSP(strategy.Strategy):
    name = "dsp"
    Options = DSPOptions
    measures = (PipelineMeasure(),)
    Section = Pipeline

    def check(self, options):
        if options.stages is not None and options.stages < 1:
            raise ConfigError(f"--stages must be >= 1, got {options.stages}")
        if options.grad_scale <= 0:
            raise ConfigError(f"--dsp_grad_scale must be > 0, got {options.grad_scale}")

    def decide(self, request):
        return plan.decide(request)

    def rewrite(self, request):
        return rewrite(request)
