"""DSP's section of the plan: the pipeline's stages, where each begins and who runs it. It
prints below the plan's table and travels with it as JSON (Strategy.Section)."""
from __future__ import annotations

import dataclasses
from typing import List, Optional

from parallax_tf import routes
from parallax_tf.plan import human_bytes


@dataclasses.dataclass
class Stage:
    """DSP: one stage of the pipeline. Pipeline p runs stage k on rank p * stages + k."""
    index: int
    ranks: List[int]               # one per pipeline (replica)
    variables: List[str]
    compute_share: float           # of the measured step, recompute included
    input: Optional[str] = None    # the cut tensor it receives (None: stage 0 reads the data)
    input_shape: List[int] = dataclasses.field(default_factory=list)    # per example
    input_bytes_per_example: int = 0


@dataclasses.dataclass
class Pipeline:
    """DSP: consecutive stages, `replicas` pipelines side by side (data parallel across them)."""
    stages: List[Stage]
    replicas: int = 1
    grad_scale: float = 1.0        # a stale stage's gradient is scaled by it (FDG's beta)
    schedule: str = "dsp"          # "locked": one batch in the pipeline at a time (the baseline)

    @property
    def staleness(self) -> List[int]:
        """Batches between a stage's forward of a batch and its update with it: 2(K-1-k)."""
        count = len(self.stages)
        return [0 if self.schedule == "locked" else 2 * (count - 1 - k) for k in range(count)]

    def stage_of(self, rank: int) -> int:
        return rank % len(self.stages)

    def pipeline_of(self, rank: int) -> int:
        return rank // len(self.stages)

    def lines(self) -> List[str]:
        """What the plan's table shows of the pipeline, below the totals."""
        lines = [f"{len(self.stages)} stage(s) x {self.replicas} pipeline(s), schedule {self.schedule}; staleness "
                 f"per stage {self.staleness}; stale gradients scaled by {self.grad_scale:g}"]
        for stage, stale in zip(self.stages, self.staleness):
            source = "reads the data" if stage.input is None else \
                (f"receives {stage.input} [{'x'.join(map(str, stage.input_shape))}] "
                 f"{human_bytes(stage.input_bytes_per_example)}/example")
            lines.append(f"stage {stage.index} on rank(s) {stage.ranks}: {stage.compute_share:.0%} of the compute, "
                         f"{source}; variables {', '.join(stage.variables)}")
        return lines

    @classmethod
    def from_dict(cls, raw: dict) -> "Pipeline":
        raw = dict(raw)
        return cls(stages=[Stage(**s) for s in raw.pop("stages")], **raw)


class StageRoute(routes.Route):
    name = "stage"
    summary = ("DSP: a variable of pipeline stage params['stage'], trained by that stage's ranks (params['ranks']: "
               "one per pipeline); the plan's section says where stages begin")


ROUTE_STAGE = routes.register(StageRoute()).name
