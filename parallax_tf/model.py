"""What a user's model_fn returns and what ptf.run hands back."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import numpy as np


@dataclasses.dataclass
class Model:
    """Returned by model_fn: a scalar loss built in the default graph and a v1 optimizer."""
    loss: object
    optimizer: object


@dataclasses.dataclass
class RunContext:
    """Passed to model_fn(ctx) and input_fn(ctx): who this rank is and which step runs."""
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    step: int = 0


@dataclasses.dataclass
class Result:
    variables: Dict[str, np.ndarray]   # single-device name -> whole final value, on every rank
    losses: List[float]                # this rank's loss per step
    plan: object = None
    global_step: int = 0
    start_step: int = 0                # > 0 when the run resumed from a checkpoint
    checkpoint: Optional[str] = None   # the last checkpoint written or resumed from
    wall_time_s: float = 0.0
    examples_per_s: Optional[float] = None
    examples_per_step: int = 0         # all ranks together
    bytes_per_step: Dict[str, float] = dataclasses.field(default_factory=dict)   # this rank, per route
    lower_bound_bytes_per_step: float = 0.0   # the least this rank's share of the plan must move
    step_times: List[float] = dataclasses.field(default_factory=list)
    cpu_s_per_step: float = 0.0       # this process's CPU time (all threads, servers included)
    link_bytes: Optional[Dict[str, int]] = None   # this host's link tx/rx over the training loop
