"""What inspection (parallax_tf.inspect_graph.capture) found of a model: every trainable
variable, the model's state, its initial values and what the strategies measured; the planner
and the strategies read it."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import numpy as np

from parallax_tf.plan import InputDecision


@dataclasses.dataclass
class VariableInfo:
    name: str                      # single-device (logical) name, without ":0"
    shape: List[int]
    dtype: str
    bytes: int
    gradient: str                  # sparse | dense | none
    layer: str
    rows_touched: Optional[int]    # unique rows one rank's batch touches (sparse only)
    gathered_bytes: Optional[int]  # bytes its lookups return for one batch, repeats included
    user_partitioned: bool
    part_names: List[str]          # the variables holding it in the capture graph
    part_rows: List[int]
    split_refusal: str             # why the toolkit cannot split it into row shards ("": it can)
    # its apply needs a sparse gradient's repeated rows one by one (not summed per id first)
    rows_each: bool = False

    @property
    def row_bytes(self) -> int:
        return self.bytes // max(1, self.shape[0]) if self.shape else self.bytes


@dataclasses.dataclass
class StateInfo:
    """A non-trainable variable of the model (batch-norm statistics, an EMA, a counter)."""
    name: str
    shape: List[int]
    dtype: str
    bytes: int
    per_rank: bool     # its updates read this rank's batch: combined over ranks (mean) when read
    layer: str


@dataclasses.dataclass
class Capture:
    variables: List[VariableInfo]
    initial_values: Dict[str, np.ndarray]   # logical name -> whole value (model variables and state)
    placeholders: List[str]                 # placeholder names the loss needs fed
    optimizer_name: str
    compute_s: Optional[float] = None       # one single-device forward+backward, when timed
    state: List[StateInfo] = dataclasses.field(default_factory=list)
    global_step: Optional[str] = None       # the model's own global step, when its train op advances one
    measured: Dict[str, object] = dataclasses.field(default_factory=dict)   # Measure.name -> what it found
    metrics: List[str] = dataclasses.field(default_factory=list)   # the names in Model.metrics
    # the model's dynamic tables (parallax_tf.dynamic): DynamicEmbedding.describe() and the row rule
    dynamic_tables: List[Dict[str, object]] = dataclasses.field(default_factory=list)
    # the tf.data pipelines model_fn builds, in the order it makes them: sharded or read as built
    inputs: List[InputDecision] = dataclasses.field(default_factory=list)
    dialect: str = "a model_fn"            # the front end's (parallax_tf.front_end)
    traced: bool = False                   # a traced TF2 step: only some strategies can rewrite it
