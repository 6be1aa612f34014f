"""Where a model can be cut into consecutive pipeline stages (DSP), measured on the capture run.

A cut point is one tensor T of the forward pass, not inside a layer (between its weights and its
bias add), such that the loss, above T, reads from below
only T itself, the model's raw inputs (labels: they travel with the activation) and values
computed from neither variables nor inputs (constants, which every stage has). T must be a
floating activation with a free batch dimension and a static shape per example, computed from
some variable and from the input; no variable may be read on both sides.

`find` lists every cut point with what lies below it (ops, variables), its bytes per example and
the forward / backward compute below it, from per-op times of the captured step (TF's step
stats; a gradient op counts for the forward op it differentiates). The planner chooses among
them (pipeline_split); the rewriter only needs the names.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional

import tensorflow as tf

from parallax_tf import graph_walk, training_record
from parallax_tf.compat import tensorflow as tf_shim

_GRADIENT_OP = re.compile(r".*gradients(?:_\d+)?/(.+?)_grad/")


@dataclasses.dataclass
class CutPoint:
    name: str                   # the tensor, e.g. "hidden1/Tanh:0"
    shape: List[int]            # per example
    dtype: str
    bytes_per_example: int
    below_ops: List[str]        # forward ops computing it (sorted names)
    variables: List[str]        # trainable variables (logical names) read below it
    forward_s: float            # one batch's forward compute below it
    backward_s: float           # and its backward


@dataclasses.dataclass
class PipelineCuts:
    points: List[CutPoint]      # every valid cut, fewest ops below first
    variables: List[str]        # every trainable variable the loss reads
    forward_s: float            # the whole forward pass of one batch
    backward_s: float
    problems: Dict[str, str]    # other activations: why each is not a cut point


def find(loss: tf.Tensor, parts: Dict[str, list], op_seconds: Dict[str, float]) -> PipelineCuts:
    """`parts`: logical name -> the variables holding it; `op_seconds`: op name -> seconds of one
    captured step (see `op_times`)."""
    forward = graph_walk.ancestors(loss.op, data_only=True)
    storage = {training_record.storage(v).name: name for name, variables in parts.items() for v in variables}
    reads = {op: _variables_of(op, storage) for op in forward}
    total_fwd, total_bwd = _seconds(forward, op_seconds)
    points, problems = [], {}
    for op in sorted(forward, key=tf_shim.creation_order):
        for tensor in op.outputs:
            if not (tensor.dtype.is_floating and tensor.shape.rank):
                continue
            why, point = _check(tensor, forward, reads, op_seconds)
            if point is not None:
                points.append(point)
            elif why:
                problems[tensor.name] = why
    points.sort(key=lambda p: (len(p.below_ops), p.bytes_per_example, p.name))
    used = sorted(set().union(*reads.values()))
    return PipelineCuts(points, used, total_fwd, total_bwd, problems)


def _check(tensor, forward: set, reads: dict, op_seconds):
    """(why not, None) or (None, the cut point); (None, None) for tensors that are not
    activations at all (nothing to explain)."""
    below = graph_walk.ancestors(tensor.op, data_only=True)
    below_vars = set().union(*(reads[op] for op in below))
    from_input = any(op.type in graph_walk.INPUT_OPS for op in below)
    if not below_vars or not from_input:
        return None, None
    above = forward - below
    if not above:
        return "it is the loss itself: nothing would be left for a later stage", None
    if any(op.type == "BiasAdd" for op in tensor.consumers() if op in above):
        return "it enters a bias add: a stage boundary goes after a whole layer, not between its weights and bias", None
    above_vars = set().union(*(reads[op] for op in above))
    shared = sorted(below_vars & above_vars)
    if shared:
        return f"variable {shared[0]!r} is read both below and above it", None
    for op in sorted(above, key=tf_shim.creation_order):
        for t in op.inputs:
            if t.op in below and t is not tensor and t.dtype != tf.resource and t.op.type not in graph_walk.INPUT_OPS:
                if any(reads[a] for a in graph_walk.ancestors(t.op, data_only=True)):
                    return (f"{op.name!r} above it also reads {t.name!r}, another activation from below "
                            "(a skip connection): a stage boundary must cross exactly one activation"), None
    dims = tensor.shape.as_list()
    if dims[0] is not None:
        return f"its batch dimension is fixed ({dims[0]}); build the inputs with a None batch dimension", None
    if any(d is None for d in dims[1:]):
        return f"its shape per example is not static ({dims})", None
    count = 1
    for d in dims[1:]:
        count *= d
    fwd, bwd = _seconds(below, op_seconds)
    return None, CutPoint(name=tensor.name, shape=dims[1:], dtype=tensor.dtype.name,
                          bytes_per_example=count * tensor.dtype.size, below_ops=sorted(op.name for op in below),
                          variables=sorted(below_vars), forward_s=fwd, backward_s=bwd)


def _variables_of(op, storage: Dict[str, str]) -> set:
    return {storage[t.name] for t in op.inputs if t.name in storage}


def _seconds(ops, op_seconds) -> tuple:
    names = {op.name for op in ops}
    forward = sum(op_seconds.get(n, 0.0) for n in names)
    backward = sum(s for n, s in op_seconds.items() if _differentiated(n) in names)
    return forward, backward


def _differentiated(op_name: str) -> Optional[str]:
    match = _GRADIENT_OP.match(op_name)
    return match.group(1) if match else None


def op_times(sess, fetches, feeds, repeats: int = 3) -> Dict[str, float]:
    """Op name -> seconds in one run of `fetches` (the least over `repeats` traced runs)."""
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    sess.run(fetches, feeds)
    best: Dict[str, float] = {}
    for _ in range(repeats):
        metadata = tf.compat.v1.RunMetadata()
        sess.run(fetches, feeds, options=options, run_metadata=metadata)
        seen: Dict[str, float] = {}
        for device in metadata.step_stats.dev_stats:
            for node in device.node_stats:
                name = node.node_name.split(":")[0]
                seen[name] = seen.get(name, 0.0) + node.op_end_rel_micros / 1e6
        for name, seconds in seen.items():
            best[name] = min(best.get(name, seconds), seconds)
    return best


# ---- choosing the cuts (plain data) --------------------------------------------------------
BALANCE_SLACK = 1.10    # cuts within 10% of the most balanced may be chosen for fewer bytes


def stage_costs(cuts: PipelineCuts, chosen: List[CutPoint]) -> List[float]:
    """Seconds per batch of each stage: forward, backward and, on every stage but the last, the
    forward again (DSP recomputes it on the stored input)."""
    bounds = [None] + list(chosen) + [None]
    costs = []
    for k in range(len(bounds) - 1):
        costs.append(_cost(cuts, bounds[k], bounds[k + 1]))
    return costs


def _cost(cuts: PipelineCuts, low: Optional[CutPoint], high: Optional[CutPoint]) -> float:
    fwd = (high.forward_s if high else cuts.forward_s) - (low.forward_s if low else 0.0)
    bwd = (high.backward_s if high else cuts.backward_s) - (low.backward_s if low else 0.0)
    return fwd + bwd + (fwd if high is not None else 0.0)


def balanced(cuts: PipelineCuts, stages: int) -> List[CutPoint]:
    """stages - 1 nested cut points, each stage training at least one variable, minimising the
    slowest stage; among choices within BALANCE_SLACK of that, the fewest bytes crossing.
    Raises ValueError when the model has fewer places to cut."""
    if stages == 1:
        return []
    search = _CutSearch(cuts, stages)
    slowest = search.solve(None)
    if slowest is None:
        raise ValueError(f"the model can be cut into at most {most_stages(cuts)} stage(s)")
    cheapest = search.solve(slowest[0] * BALANCE_SLACK + 1e-12)
    return cheapest[1] if cheapest else slowest[1]


class _CutSearch:
    """The dynamic program behind `balanced`: chains of stages - 1 nested cut points."""

    def __init__(self, cuts: PipelineCuts, stages: int):
        self.cuts, self.stages = cuts, stages
        self.points = cuts.points
        self.below = [set(p.below_ops) for p in self.points]
        self.variables = [set(p.variables) for p in self.points]
        self.everything = set(cuts.variables)

    def follows(self, i, j) -> bool:      # cut j may come after cut i (i None: the input)
        if i is None:
            return bool(self.variables[j])
        return self.below[i] < self.below[j] and bool(self.variables[j] - self.variables[i])

    def last_ok(self, j) -> bool:
        return bool(self.everything - self.variables[j])

    def value(self, bound, prev, i, j) -> float:
        """The chain's value with cut j after cut i: its slowest stage (bound None), or its bytes
        while every stage stays within `bound`."""
        cost = _cost(self.cuts, self.points[i] if i is not None else None, self.points[j])
        if bound is None:
            return max(prev, cost)
        return prev + self.points[j].bytes_per_example if cost <= bound else float("inf")

    def solve(self, bound):
        """(max cost or bytes, choice) minimising the slowest stage (bound None) or the bytes
        under `bound`."""
        inf = float("inf")
        n, stages = len(self.points), self.stages
        # best[m][j]: the best value with m + 1 cuts, the last at j; back[m][j]: the one before
        best = [[inf] * n for _ in range(stages - 1)]
        back = [[None] * n for _ in range(stages - 1)]
        for j in range(n):
            if self.follows(None, j):
                best[0][j] = self.value(bound, 0.0, None, j)
        for m in range(1, stages - 1):
            for j in range(n):
                for i in range(n):
                    if best[m - 1][i] < inf and self.follows(i, j):
                        v = self.value(bound, best[m - 1][i], i, j)
                        if v < best[m][j]:
                            best[m][j], back[m][j] = v, i
        return self.finish(bound, best, back)

    def finish(self, bound, best, back):
        """The best chain whose last stage trains a variable and keeps within `bound`, read back
        from its last cut; None when there is none."""
        inf = float("inf")
        finish = []
        for j in range(len(self.points)):
            if best[-1][j] < inf and self.last_ok(j):
                cost = _cost(self.cuts, self.points[j], None)
                total = max(best[-1][j], cost) if bound is None else (best[-1][j] if cost <= bound else inf)
                finish.append((total, j))
        if not finish or min(finish)[0] == inf:
            return None
        total, j = min(finish)
        chosen = [j]
        for m in range(self.stages - 2, 0, -1):
            j = back[m][j]
            chosen.append(j)
        return total, [self.points[i] for i in reversed(chosen)]


def most_stages(cuts: PipelineCuts) -> int:
    """The longest chain of nested cut points with variables between each: stages possible."""
    points = cuts.points
    below = [set(p.below_ops) for p in points]
    variables = [set(p.variables) for p in points]
    longest = []
    for j, p in enumerate(points):
        if not variables[j] or not set(cuts.variables) - variables[j]:
            longest.append(0)
            continue
        prior = [longest[i] for i in range(j) if longest[i] and below[i] < below[j] and variables[j] - variables[i]]
        longest.append(1 + max(prior, default=0))
    return 1 + max(longest, default=0)


def check_named(cuts: PipelineCuts, names: List[str]) -> List[CutPoint]:
    """The user's cut tensors (--dsp_cuts), in order; ValueError naming the first bad one."""
    by_name = {p.name: p for p in cuts.points}
    chosen = []
    for name in names:
        full = name if ":" in name else name + ":0"
        if full not in by_name:
            why = cuts.problems.get(full, "it is not an activation on the way to the loss (computed from the "
                                          "input and some variable)")
            raise ValueError(f"{full!r} cannot begin a stage: {why}")
        point = by_name[full]
        if chosen and not (set(chosen[-1].below_ops) < set(point.below_ops)
                           and set(point.variables) - set(chosen[-1].variables)):
            raise ValueError(f"{full!r} does not come after {chosen[-1].name!r} with a trained layer between them: "
                             "list the cuts from the input towards the loss, one trained layer at least between two")
        chosen.append(point)
    if chosen and not set(cuts.variables) - set(chosen[-1].variables):
        raise ValueError(f"no trained variable is left above {chosen[-1].name!r} for the last stage")
    return chosen
