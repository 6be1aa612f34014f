"""The contract between the core (inspect, plan, run) and a technique.

A technique is one package under rewriters/ that registers a `Strategy` per --strategy name: its
options (a dataclass whose fields name their absl flags), what inspection must measure for it,
its planning rule, its rewrite and, through the graph it returns, its runner. The core reaches
the techniques only through this registry; `import parallax_tf` fills it (parallax_tf.api
imports rewriters). docs/design.md walks through adding one.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Protocol, Sequence, Tuple

from parallax_tf import plan as plan_lib
from parallax_tf.errors import ConfigError

if TYPE_CHECKING:         # types only: importing these here would make cycles
    import tensorflow as tf

    from parallax_tf.costmodel import Cluster
    from parallax_tf.inspect_graph import Capture
    from parallax_tf.model import RunContext
    from parallax_tf.plan import Plan
    from parallax_tf.runtime.barriers import CollectiveBarrier
    from parallax_tf.runtime.runner import Runner
    from parallax_tf.runtime.topology import Topology


# ---- options ----------------------------------------------------------------------------------
def option(default, flag: str, help: str, choices: Optional[Sequence[str]] = None, kind: Optional[str] = None):
    """A field of an options dataclass (a strategy's, or the core's in parallax_tf.flags), set by
    the absl flag `flag`. `kind`: "list" for a comma-separated flag, "int" or "float" for a
    number whose default is None (default: from the default's type)."""
    factory = {"default_factory": lambda: list(default)} if isinstance(default, list) else {"default": default}
    return dataclasses.field(metadata={"flag": flag, "help": help, "choices": choices, "kind": kind}, **factory)


@dataclasses.dataclass
class NoOptions:
    pass


def flag_names(options_type) -> Dict[str, str]:
    """Flag name -> field name of an options dataclass."""
    return {f.metadata["flag"]: f.name for f in dataclasses.fields(options_type)}


def define_flags(options_type, module_name: Optional[str] = None) -> None:
    """Defines the absl flags of an options dataclass (once per process); `module_name`: the
    module --helpfull lists them under (default: absl's guess, the caller's)."""
    from absl import flags
    where = {"module_name": module_name} if module_name else {}
    for field in dataclasses.fields(options_type):
        meta = field.metadata
        name, default = meta["flag"], field.default if field.default is not dataclasses.MISSING \
            else field.default_factory()
        if name in flags.FLAGS:
            continue
        if meta["choices"]:
            flags.DEFINE_enum(name, default, list(meta["choices"]), meta["help"], **where)
        elif meta["kind"] == "list" or isinstance(default, list):
            flags.DEFINE_list(name, default, meta["help"], **where)
        elif isinstance(default, bool):
            flags.DEFINE_bool(name, default, meta["help"], **where)
        elif meta["kind"] == "float" or isinstance(default, float):
            flags.DEFINE_float(name, default, meta["help"], **where)
        elif isinstance(default, int) or (default is None and meta["kind"] == "int"):
            flags.DEFINE_integer(name, default, meta["help"], **where)
        else:
            flags.DEFINE_string(name, default, meta["help"], **where)


# ---- planning ---------------------------------------------------------------------------------
@dataclasses.dataclass
class PlanRequest:
    """What the planner and a planning rule get: the inspected model, the strategy, the cluster,
    and the options."""
    capture: Capture
    strategy: str                         # --strategy
    num_ranks: int
    num_hosts: int
    partitions: Optional[int] = None      # --partitions: forced shard count of sparse PS variables
    local_aggregation: bool = True
    cost_cluster: Optional[Cluster] = None    # what the cost model plans for
    options: Any = None                   # this strategy's options dataclass (a dict of its fields: over the defaults)
    all_options: Dict[str, Any] = dataclasses.field(default_factory=dict)   # strategy -> its options
    dynamic_tables: Optional[str] = None  # --dynamic_tables: every dynamic table's route (None: the rule's)
    steps: Optional[int] = None           # --steps: how many ids a dynamic table can meet (None: not known)

    def __post_init__(self):
        self.all_options = dict(self.all_options or {})
        if self.options is None or isinstance(self.options, dict):
            self.options = get(self.strategy).Options(**(self.options or {}))

    def options_of(self, name: str):
        """Another strategy's options (a rule that may choose it): as parsed, else its defaults."""
        return self.all_options.get(name) or get(name).Options()

    @functools.cached_property
    def loads(self):
        """The cost model's per-variable loads (computed once per plan)."""
        from parallax_tf import costmodel
        return costmodel.loads_from(self.capture)


class PlanSection(Protocol):
    """A strategy's own plan data (Strategy.Section): printed below the plan's table, carried in
    its JSON (dataclasses.asdict there, from_dict back)."""

    def lines(self) -> List[str]: ...

    @classmethod
    def from_dict(cls, raw: dict) -> "PlanSection": ...


@dataclasses.dataclass
class Decisions:
    """A planning rule's answer; the planner turns it into the Plan's entries."""
    routes: Dict[str, Tuple[str, str]]                 # variable -> (route, why)
    params: Dict[str, dict] = dataclasses.field(default_factory=dict)   # variable -> route parameters
    partitions: Optional[Dict[str, Tuple[int, str]]] = None   # shard counts chosen (None: the planner's)
    state: Dict[str, Tuple[list, str]] = dataclasses.field(default_factory=dict)  # state -> (ranks, where)
    ranks_meet: bool = True        # False: ranks never step together, so no state is averaged over them
    section: Optional[PlanSection] = None    # the strategy's own plan data (its Strategy.Section)
    plan: Optional[Plan] = None            # a whole plan made by another strategy's rule instead
    dynamic_routes: Dict[str, Tuple[str, str]] = dataclasses.field(default_factory=dict)  # table -> (route, why)


@dataclasses.dataclass
class Offer:
    """A strategy's whole plan as an alternative another rule (auto) may weigh."""
    options: Any           # the offering strategy's options for that plan
    why: str               # its prediction against the data-parallel step, for the plan's reasons
    batches: int           # batches one of its steps trains (data parallelism: one per rank)


# ---- the protocol -----------------------------------------------------------------------------
class Strategy:
    """One --strategy. Subclasses set the class attributes and implement decide and rewrite."""
    name: str = ""
    Options: type = NoOptions
    time_compute: bool = False      # inspection times a step (the cost model's compute term)
    measures: Tuple[Any, ...] = ()   # inspect_graph.Measure objects: what else inspection finds
    # its step computes the loss once over the data ranks' batches joined: model_fn's ctx says so
    # (RunContext.batch_joined), from inspection on
    batch_joined: bool = False
    # its step trains dynamic tables (parallax_tf.dynamic): the synchronous step does
    # (rewriters/shared/dynamic_step.py); a strategy without it refuses a model that has them
    carries_dynamic_tables: bool = False
    # its rewrite takes a traced TF2 step (parallax_tf.tf2): its step is the synchronous one over
    # the model's own applies; a strategy without it refuses such a model
    trains_traced_steps: bool = False
    # the type of its own plan data (Plan.section): a dataclass with lines() (what the plan's
    # table shows of it) and from_dict() (its JSON back); None: it has none
    Section: Optional[type] = None

    def check(self, options) -> None:
        """Raises ConfigError for option values this strategy cannot run with."""

    def decide(self, request: PlanRequest) -> Decisions:
        raise NotImplementedError

    def offer(self, request: PlanRequest, data_parallel_s: float) -> Optional[Offer]:
        """This strategy's plan as an alternative to a data-parallel one predicted to take
        `data_parallel_s` a step (request.cost_cluster set): None where it would not be faster."""
        return None

    def rewrite(self, request: "BuildRequest") -> "DistributedGraph":
        raise NotImplementedError


_REGISTRY: Dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    if strategy.name in _REGISTRY and type(_REGISTRY[strategy.name]) is not type(strategy):
        raise ValueError(f"strategy {strategy.name!r} registered twice")
    define_flags(strategy.Options)
    if strategy.Section is not None:
        plan_lib.register_section(strategy.name, strategy.Section)
    _REGISTRY[strategy.name] = strategy
    return strategy


def names() -> Tuple[str, ...]:
    return tuple(_REGISTRY)


def get(name: str) -> Strategy:
    if name not in _REGISTRY:
        raise ConfigError(f"unknown strategy {name!r}; choose one of {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def option_flags() -> Dict[str, str]:
    """Every registered strategy's option flags: flag -> strategy."""
    return {flag: s.name for s in _REGISTRY.values() for flag in flag_names(s.Options)}


def parse_options(values: Dict[str, object]) -> Dict[str, object]:
    """Strategy -> its options dataclass from flag values (each strategy's checked)."""
    out = {}
    for strategy in _REGISTRY.values():
        fields = flag_names(strategy.Options)
        options = strategy.Options(**{field: values[flag] for flag, field in fields.items()})
        strategy.check(options)
        out[strategy.name] = options
    return out


# ---- rewriting --------------------------------------------------------------------------------
@dataclasses.dataclass
class BuildRequest:
    """Everything a rewriter gets: the model's front end (or a model_fn) and the decisions already taken."""
    front_end: object               # parallax_tf.front_end.FrontEnd
    ctx: RunContext
    plan: Plan
    topology: Topology
    seed: int
    shard_input: bool = True   # --shard_input: tf.data built in model_fn is sharded by ctx (rank, size)

    def __post_init__(self):
        from parallax_tf import front_end
        self.front_end = front_end.of(self.front_end)


@dataclasses.dataclass
class DistributedGraph:
    """What a rewriter built on one rank, as the runtime uses it: what to initialise, where the
    state is (for checkpoints and results), and the runner that trains it."""
    graph: tf.Graph
    loss: tf.Tensor                             # this rank's loss
    train_op: list                              # the step's targets
    global_step: tf.Tensor                      # read of the one global step
    parts: Dict[str, list]                      # logical name -> its pieces (values.Part) in this graph
    chief_init: list                            # run once by rank 0: PS state, slots, step
    local_init: tf.Operation                    # run by every rank: local replicas' state
    broadcast: Optional[tf.Operation]           # dense replicas from rank 0 to all (None: nothing)
    barrier: CollectiveBarrier                  # the run's rendezvous points
    runner: Runner                              # trains this graph
    # (optimizer, variables it updates in this graph): where slots and non-slot state live
    optimizers: List[tuple] = dataclasses.field(default_factory=list)
    working_copies: set = dataclasses.field(default_factory=set)   # variable names that are not state
    # variable name -> (checkpoint key, order): further copies of a saved value (copy 0 is read)
    saved_as: Dict[str, tuple] = dataclasses.field(default_factory=dict)
    # variable -> how lookups read its shards ("mod"/"div"), where the rewriter found out
    layouts: Dict[str, str] = dataclasses.field(default_factory=dict)
    # Why the job may go on without a rank that holds no server state ("": it may not; a lost
    # rank stops every rank).
    survivable_loss: str = ""
