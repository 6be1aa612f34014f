"""The plan: one plain-data entry per trainable variable saying which route it takes.

A plan is built by `planner.make_plan`, printed as a table, shipped to every rank as JSON and
only then applied by a rewriter. Routes are named so later techniques add kinds without
changing the ones here:
  "ps"         variable sharded over parameter servers, synchronous aggregation (Parallax)
  "allreduce"  variable replicated on every rank, gradients averaged by Horovod
  "significant" Slim-DP: a global copy on the PS (flat, split into shards of elements), a local
               replica on every rank; each round only the significant + explored coordinates
               are pushed, averaged, applied and pulled (the plan's options: the slim_* flags)
  "local"      model state that is not trained (batch-norm statistics, EMAs, counters): a copy
               on every rank, updated by the model's own ops; params["combine"] says how the
               copies are combined when read ("mean" over ranks, or "rank0")
  "async_ps"   PS+: the global copy on parameter servers, updated by each push as it arrives
               with a staleness-scaled learning rate; dense variables also have a local copy per
               rank, pulled eagerly in the background (params["pull"] "eager"), sparse ones are
               read row by row from the server in the step (params["pull"] "rows")
  "fc_node"    Stanza: a variable of the FC head, trained on the FC nodes from the conv nodes'
               activations (params["ranks"]: the FC nodes); the plan's `split` says who serves whom
  "stage"      DSP: a variable of pipeline stage params["stage"], trained by that stage's ranks
               (params["ranks"]: one per pipeline); the plan's `pipeline` says where stages begin
"""
from __future__ import annotations

import dataclasses
import json
from typing import Dict, List, Optional

ROUTE_PS = "ps"
ROUTE_ALLREDUCE = "allreduce"
ROUTE_LOCAL = "local"
ROUTE_SIGNIFICANT = "significant"
ROUTE_ASYNC_PS = "async_ps"
ROUTE_FC_NODE = "fc_node"
ROUTE_STAGE = "stage"
KNOWN_ROUTES = (ROUTE_PS, ROUTE_ALLREDUCE, ROUTE_LOCAL, ROUTE_SIGNIFICANT, ROUTE_ASYNC_PS, ROUTE_FC_NODE, ROUTE_STAGE)
TOOLKIT_GLOBAL_STEP = "parallax_global_step"    # the global step a rewrite adds when the model has none


@dataclasses.dataclass
class Shard:
    """Rows [row_start, row_end) of a PS variable, stored on parameter server `server` (for
    layout "flat", elements of the flattened variable)."""
    name: str          # variable name of the shard in the distributed graph
    row_start: int
    row_end: int
    server: int        # index into Plan.servers


@dataclasses.dataclass
class VariablePlan:
    name: str                       # single-device variable name, e.g. "emb" (no ":0")
    shape: List[int]
    dtype: str
    bytes: int
    gradient: str                   # "sparse" | "dense"
    layer: str                      # embedding | conv | fully_connected | norm | bias | other
    route: str
    reason: str
    bytes_per_step: int             # estimated bytes one rank moves for it per step
    shards: List[Shard] = dataclasses.field(default_factory=list)
    user_partitioned: bool = False  # the model itself partitioned it (fixed_size_partitioner)
    layout: str = "div"             # rows on shards: "div" contiguous, "mod" strided (the
                                    # rewriter sets it from how the lookups read the shards);
                                    # "flat": shards hold element ranges of the flattened value
    fusion_group: Optional[int] = None  # AllReduce: tensors of one group go in one fused call
    # Parameters of the route, for later techniques (stage index, staleness, FC node, ...).
    params: Dict[str, object] = dataclasses.field(default_factory=dict)

    @property
    def partitions(self) -> int:
        return len(self.shards)


@dataclasses.dataclass
class CutTensor:
    """A tensor where the FC head begins (Stanza): computed on the conv nodes, sent to an FC node."""
    name: str                   # the tensor in the single-device graph, e.g. "Reshape:0"
    shape: List[int]            # per example (the batch dimension left out); whole for "replicated"
    dtype: str
    bytes_per_example: int      # for "replicated": its bytes per step
    kind: str                   # activation (its gradient goes back) | data (labels) | replicated


@dataclasses.dataclass
class LayerSplit:
    """Stanza: who trains what. The last ranks are FC nodes; each serves a group of conv nodes."""
    conv_ranks: List[int]
    fc_ranks: List[int]
    groups: List[List[int]]     # per FC node, in fc_ranks order: the conv ranks it serves
    cut: List[CutTensor]
    microbatches: int = 1       # each conv node's batch crosses the cut in this many pieces
    # conv nodes send their activations one at a time (one collective per position in a group),
    # so an FC node's port never takes a whole group's at once (TCP incast)
    staggered: bool = False
    sends_reason: str = ""      # why together or staggered

    def group_of(self, rank: int) -> List[int]:
        """The conv ranks of the group `rank` belongs to, its FC node last."""
        for fc, group in zip(self.fc_ranks, self.groups):
            if rank == fc or rank in group:
                return group + [fc]
        raise ValueError(f"rank {rank} is in no group of {self.groups}")


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


@dataclasses.dataclass
class Plan:
    strategy: str
    num_ranks: int
    num_hosts: int
    servers: List[str]              # per host, the server holding its PS state: "host:port" once known
    local_aggregation: bool
    variables: List[VariablePlan]
    global_step: Optional[str] = None   # the model's own global step variable, if its train op advances one
    split: Optional[LayerSplit] = None  # Stanza's conv and FC nodes and the cut between them
    pipeline: Optional[Pipeline] = None  # DSP's stages
    options: Dict[str, object] = dataclasses.field(default_factory=dict)  # the strategy's options, by field
    devices: Optional[str] = None       # on GPU ranks, what runs where (parallax_tf.devices.summary)

    def by_name(self) -> Dict[str, VariablePlan]:
        return {v.name: v for v in self.variables}

    def on_route(self, route: str) -> List[VariablePlan]:
        return [v for v in self.variables if v.route == route]

    @property
    def trained(self) -> List[VariablePlan]:
        """The trainable variables (everything but model state)."""
        return [v for v in self.variables if v.route != ROUTE_LOCAL]

    # ---- serialisation -------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        raw = json.loads(text)
        variables = []
        for v in raw.pop("variables"):
            shards = [Shard(**s) for s in v.pop("shards")]
            variables.append(VariablePlan(shards=shards, **v))
        split = raw.pop("split", None)
        if split is not None:
            split = LayerSplit(cut=[CutTensor(**t) for t in split.pop("cut")], **split)
        pipeline = raw.pop("pipeline", None)
        if pipeline is not None:
            pipeline = Pipeline(stages=[Stage(**s) for s in pipeline.pop("stages")], **pipeline)
        return cls(variables=variables, split=split, pipeline=pipeline, **raw)

    # ---- display ---------------------------------------------------------------------------
    @property
    def global_step_key(self) -> str:
        """The global step's name in the graph and in checkpoints: the model's own, else the toolkit's."""
        return self.global_step or TOOLKIT_GLOBAL_STEP

    def table(self) -> str:
        header = ("variable", "shape", "MB", "grad", "layer", "route", "shards", "est. bytes/step/rank")
        rows = [header]
        for v in self.variables:
            shards = str(v.partitions) if v.route in (ROUTE_PS, ROUTE_SIGNIFICANT, ROUTE_ASYNC_PS) else \
                ("mean" if v.params.get("combine") == "mean" and v.route == ROUTE_LOCAL else "-")
            if v.route == ROUTE_PS and v.user_partitioned:
                shards += " (user)"
            rows.append((v.name, "x".join(map(str, v.shape)) or "scalar", f"{v.bytes / 2**20:.2f}",
                         v.gradient, v.layer, v.route, shards, human_bytes(v.bytes_per_step)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        total = sum(v.bytes_per_step for v in self.variables)
        lines.append(f"strategy={self.strategy} ranks={self.num_ranks} hosts={self.num_hosts} "
                     f"local_aggregation={self.local_aggregation} "
                     f"global_step={self.global_step_key} "
                     f"est. bytes/step/rank={human_bytes(total)}")
        if self.devices:
            lines.append(f"devices: {self.devices}")
        if self.split is not None:
            lines.extend(self.split_lines())
        if self.pipeline is not None:
            lines.extend(self.pipeline_lines())
        return "\n".join(lines)

    def pipeline_lines(self) -> List[str]:
        pipe = self.pipeline
        lines = [f"{len(pipe.stages)} stage(s) x {pipe.replicas} pipeline(s), schedule {pipe.schedule}; staleness per stage "
                 f"{pipe.staleness}; stale gradients scaled by {pipe.grad_scale:g}"]
        for stage, stale in zip(pipe.stages, pipe.staleness):
            source = "reads the data" if stage.input is None else \
                f"receives {stage.input} [{'x'.join(map(str, stage.input_shape))}] {human_bytes(stage.input_bytes_per_example)}/example"
            lines.append(f"stage {stage.index} on rank(s) {stage.ranks}: {stage.compute_share:.0%} of the compute, "
                         f"{source}; variables {', '.join(stage.variables)}")
        return lines

    def split_lines(self) -> List[str]:
        split = self.split
        lines = [f"FC nodes {split.fc_ranks}, conv nodes {split.conv_ranks}; "
                 + "; ".join(f"rank {fc} serves {group}" for fc, group in zip(split.fc_ranks, split.groups))
                 + (f"; {split.microbatches} micro-batches per step" if split.microbatches > 1 else "")
                 + ("; conv nodes send one at a time (staggered)" if split.staggered else "")]
        if split.sends_reason:
            lines.append(f"sends: {split.sends_reason}")
        for t in split.cut:
            per = "per step, sent by one conv node" if t.kind == "replicated" else "per example"
            lines.append(f"cut: {t.name} [{'x'.join(map(str, t.shape)) or 'scalar'}] {t.dtype} "
                         f"{human_bytes(t.bytes_per_example)} {per} ({t.kind})")
        return lines

    def reasons(self) -> str:
        return "\n".join(f"{v.name}: {v.reason}" for v in self.variables)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}"
