"""The plan: one plain-data entry per trainable variable saying which route it takes.

A plan is built by `planner.make_plan`, printed as a table, shipped to every rank as JSON and
only then applied by a rewriter. Each entry names a route (parallax_tf/routes.py: the core's
"ps", "allreduce" and "local", and those the techniques register) and the route's parameters;
a strategy with plan data of its own (Stanza's layer split, DSP's pipeline) keeps it in
`Plan.section`, a type its package defines (Strategy.Section).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Dict, List, Optional

from parallax_tf import routes

ROUTE_PS = routes.PS.name
ROUTE_ALLREDUCE = routes.ALLREDUCE.name
ROUTE_LOCAL = routes.LOCAL.name
ROUTE_ALLTOALL = routes.ALLTOALL.name
RANKS_LAYOUT = routes.RANKS_LAYOUT
TOOLKIT_GLOBAL_STEP = "parallax_global_step"    # the global step a rewrite adds when the model has none
_SECTION_TYPES: Dict[str, type] = {}             # strategy -> the type of its Plan.section


def register_section(strategy: str, section_type: type) -> None:
    """How a plan of `strategy` reads its section back from JSON (strategy.register calls it)."""
    _SECTION_TYPES[strategy] = section_type


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
                                    # "flat": shards hold element ranges of the flattened value;
                                    # "ranks": row i on data rank i % N (route alltoall)
    fusion_group: Optional[int] = None  # AllReduce: tensors of one group go in one fused call
    # Parameters of the route, for later techniques (stage index, staleness, FC node, ...).
    params: Dict[str, object] = dataclasses.field(default_factory=dict)

    @property
    def partitions(self) -> int:
        return len(self.shards)


DYNAMIC_ON_SERVERS, DYNAMIC_REPLICATED = "servers", "replicated"     # a dynamic table's routes


@dataclasses.dataclass
class DynamicTablePlan:
    """A dynamic table (parallax_tf.dynamic), trained by `optimizer`'s row rule at each step's
    end. On route "servers" its rows are sharded by id over the parameter-server hosts (shard k
    on host k % hosts); on route "replicated" every rank holds the whole table and applies every
    rank's push (allgathered) to its copy."""
    name: str
    dim: int
    dtype: str
    initializer: str
    admit_after: int
    evict_after_steps: Optional[int]
    capacity: Optional[int]
    optimizer: str
    shards: int
    compiles: bool = True                # it can be replicated (dynamic.compiled.compiles)
    slots: int = 0                       # the optimizer's slots kept per row
    ids_per_step: Optional[int] = None   # distinct ids one rank's batch reads (inspect; None: not measured)
    rows_at_start: int = 0               # rows it holds before training (a Keras layer's last run)
    route: str = DYNAMIC_ON_SERVERS
    reason: str = ""

    def line(self) -> str:
        limits = [f"admit after {self.admit_after}"]
        if self.evict_after_steps is not None:
            limits.append(f"evict after {self.evict_after_steps} steps unseen")
        if self.capacity is not None:
            limits.append(f"capacity {self.capacity} rows")
        where = f"{self.shards} shards by id" if self.route == DYNAMIC_ON_SERVERS else \
            "replicated on every rank (pushes allgathered)"
        why = f" ({self.reason})" if self.reason else ""
        return (f"dynamic table {self.name}: dim {self.dim} {self.dtype}, {where}{why}, "
                f"{self.optimizer} per row, {self.initializer}, {', '.join(limits)}")


@dataclasses.dataclass
class InputDecision:
    """One tf.data pipeline model_fn builds: whether the toolkit shards it, and why."""
    iterator: str          # the op name of the iterator it was made into (rank 0's graph)
    sharded: bool
    why: str

    def line(self) -> str:
        how = "sharded by the toolkit (rank r of N reads batches r, r+N, ...)" if self.sharded else \
            "read as built"
        return f"input {self.iterator}: {how}: {self.why}"


@dataclasses.dataclass
class Plan:
    strategy: str
    num_ranks: int
    num_hosts: int
    servers: List[str]              # per host, the server holding its PS state: "host:port" once known
    local_aggregation: bool
    variables: List[VariablePlan]
    global_step: Optional[str] = None   # the model's own global step variable, if its train op advances one
    # the strategy's own plan data (its Strategy.Section: Stanza's layer split, DSP's pipeline)
    section: Optional[object] = None
    options: Dict[str, object] = dataclasses.field(default_factory=dict)  # the strategy's options, by field
    devices: Optional[str] = None       # on GPU ranks, what runs where (parallax_tf.devices.summary)
    dynamic_tables: List[DynamicTablePlan] = dataclasses.field(default_factory=list)
    # the tf.data pipelines model_fn builds, in the order it makes them: sharded by the toolkit or not
    inputs: List[InputDecision] = dataclasses.field(default_factory=list)

    def by_name(self) -> Dict[str, VariablePlan]:
        return {v.name: v for v in self.variables}

    def on_route(self, route: str) -> List[VariablePlan]:
        return [v for v in self.variables if v.route == route]

    @property
    def trained(self) -> List[VariablePlan]:
        """The trainable variables (everything but model state)."""
        return [v for v in self.variables if routes.get(v.route).trained]

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
        dynamic_tables = [DynamicTablePlan(**t) for t in raw.pop("dynamic_tables", [])]
        inputs = [InputDecision(**i) for i in raw.pop("inputs", [])]
        section = raw.pop("section", None)
        if section is not None:
            section = _SECTION_TYPES[raw["strategy"]].from_dict(section)
        return cls(variables=variables, section=section, dynamic_tables=dynamic_tables, inputs=inputs, **raw)

    # ---- display ---------------------------------------------------------------------------
    @property
    def global_step_key(self) -> str:
        """The global step's name in the graph and in checkpoints: the model's own, else the toolkit's."""
        return self.global_step or TOOLKIT_GLOBAL_STEP

    def table(self) -> str:
        header = ("variable", "shape", "MB", "grad", "layer", "route", "shards", "est. bytes/step/rank")
        rows = [header]
        for v in self.variables:
            shards = routes.get(v.route).shards_cell(v)
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
        lines.extend(table.line() for table in self.dynamic_tables)
        lines.extend(pipeline.line() for pipeline in self.inputs)
        if self.devices:
            lines.append(f"devices: {self.devices}")
        if self.section is not None:
            lines.extend(self.section.lines())
        return "\n".join(lines)

    def reasons(self) -> str:
        return "\n".join(f"{v.name}: {v.reason}" for v in self.variables)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}"
