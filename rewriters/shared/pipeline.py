"""What every rewrite shares around its own step: the guard on the plan's routes, the protocol of
a route the synchronous step carries, and the one ending that turns what a strategy built into
the `DistributedGraph` the runtime runs (initialisers, rank 0's broadcast, barrier, runner).

A rewrite is: check_routes -> rebuild the model (rewriters/shared/rebuild.py) -> the strategy's
own step -> start_variables -> finish_graph. rewriters/shared/sync.py is the synchronous
data-parallel step built from SyncRoute objects; docs/design.md has the table of its stages.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Callable, Dict, Iterable, List, Optional

import tensorflow as tf

from parallax_tf.runtime.barriers import CollectiveBarrier
from parallax_tf.strategy import BuildRequest, DistributedGraph
from rewriters.shared.rebuild import Rebuilt


def check_routes(plan, buildable: Iterable[str], strategy: str) -> None:
    """Refuses a plan with a variable on a route this rewriter cannot build."""
    other = sorted({v.route for v in plan.variables} - set(buildable))
    if other:
        raise ValueError(f"the {strategy} rewriter cannot build route(s) {other}")


# ---- routes of the synchronous step -----------------------------------------------------------
@dataclasses.dataclass
class RouteState:
    """What a further route adds to a synchronous graph once built."""
    broadcast: object                 # the start of every rank's copies (after the replicas' broadcast)
    parts: Dict[str, list]            # its variables' pieces: where their state is
    working_copies: set               # variables that are not state (the rank's local replicas)
    optimizers: List[tuple]           # (optimizer, variables) of its own
    scheduled: Callable[[int], tuple]  # SyncStep.scheduled


class SyncRoute(abc.ABC):
    """A route the synchronous step carries gradients along (rewriters/shared/sync.py). The step
    calls build() before the model's transform is rewired, after_step() once the step's targets
    exist, and finish() once every rank's replicas are broadcast. The PS and AllReduce routes
    add what their place in the step needs (the PS route's release and wait)."""
    bytes: Dict[str, tf.Tensor]       # report name -> bytes this rank moves on the route per step
    lower_bound: List[tf.Tensor]      # per variable: the least this rank must move for it

    @abc.abstractmethod
    def build(self) -> Dict[str, object]:
        """Variable op name -> the gradient the model's transform reads (on this rank)."""

    def after_step(self, step_targets: list) -> list:
        """Builds what follows the step (`step_targets`); returns targets every step also runs."""
        return []

    def finish(self, broadcast) -> Optional[RouteState]:
        """What the route adds to the graph, built after `broadcast` (None: nothing)."""
        return None

    def kept_per_rank(self) -> list:
        """Variables each rank keeps its own values of: not broadcast from rank 0."""
        return []

    def layouts(self) -> Dict[str, str]:
        """Saved name -> layout of state the route shaped itself (beyond the plan's entries)."""
        return {}


# factory(request, rebuilt, the plan's entries on the route) -> the route
RouteFactory = Callable[[BuildRequest, Rebuilt, list], SyncRoute]


# ---- the ending -------------------------------------------------------------------------------
@dataclasses.dataclass
class Start:
    """How this rank's variables get their first values: rank 0 initialises those on servers,
    every rank its own, and `broadcast` (None: none) then makes every rank's own rank 0's."""
    on_server: list
    local: list
    broadcast: object = None
    own: list = dataclasses.field(default_factory=list)    # each rank's own values, not broadcast

    def keep_own(self, variables) -> None:
        """`variables` start as each rank's own (initialised, never broadcast)."""
        names = {v.name for v in variables}
        self.own += [v for v in self.local if v.name in names]
        self.local = [v for v in self.local if v.name not in names]

    def broadcast_local(self):
        """Every local copy starts as rank 0's (which may come from a checkpoint)."""
        import horovod.tensorflow as hvd
        self.broadcast = hvd.broadcast_variables(self.local, root_rank=0)
        return self.broadcast


def start_variables() -> Start:
    """The model's variables now, split by where they live."""
    variables = tf.compat.v1.global_variables()
    return Start(on_server=[v for v in variables if "/job:ps" in v.device],
                 local=[v for v in variables if "/job:ps" not in v.device])


def applied_optimizers(training) -> List[tuple]:
    """(optimizer, variables it updates) of every apply in the model's train op."""
    return [(a.optimizer, [v for g, v in a.grads_and_vars if g is not None]) for a in training.applies]


def finish_graph(start: Start, *, loss, train_op, global_step, parts, runner, optimizers: List[tuple],
                 broadcast_local: bool = False, barrier=None, chief_init: Iterable = (),
                 working_copies: Optional[set] = None, saved_as: Optional[dict] = None,
                 layouts: Optional[dict] = None, survivable_loss: str = "") -> DistributedGraph:
    """The DistributedGraph of what a strategy built. Rank 0 runs the servers' initialiser, then
    `chief_init` and the barrier's own; `broadcast_local`: the local copies' broadcast from rank
    0 is made here, after the initialisers (else `start.broadcast` as it is); a CollectiveBarrier
    unless `barrier`; the optimizers without the working copies, which are not state."""
    working_copies = set() if working_copies is None else working_copies
    step = global_step.read_value()
    chief = [tf.compat.v1.variables_initializer(start.on_server)] if start.on_server else []
    chief += list(chief_init) + (list(barrier.init_ops) if barrier is not None else [])
    local_init = tf.group(tf.compat.v1.variables_initializer(start.local + start.own),
                          tf.compat.v1.local_variables_initializer())
    if broadcast_local:
        start.broadcast_local()
    return DistributedGraph(
        graph=tf.compat.v1.get_default_graph(), loss=loss, train_op=train_op, global_step=step, parts=parts,
        chief_init=chief, local_init=local_init, broadcast=start.broadcast,
        barrier=barrier if barrier is not None else CollectiveBarrier(), runner=runner,
        optimizers=[(o, [v for v in vs if v.name not in working_copies]) for o, vs in optimizers],
        working_copies=working_copies, saved_as=saved_as if saved_as is not None else {},
        layouts=layouts if layouts is not None else {}, survivable_loss=survivable_loss)
