"""DSP's planning rule: K consecutive stages times R pipelines, cut where the measured compute
balances (or where --dsp_cuts says), and every variable on its stage's ranks."""
from __future__ import annotations

from typing import List, Optional

from parallax_tf import strategy
from parallax_tf.errors import ConfigError
from rewriters.dsp.cut import balanced, check_named, stage_costs
from rewriters.dsp.pipeline import ROUTE_STAGE, Pipeline, Stage


def decide(request) -> strategy.Decisions:
    options = request.options
    pipeline = pipeline_split(request.capture, request.num_ranks, options.stages, options.replicas,
                              list(options.cuts), options.grad_scale, options.schedule)
    stage_of = {name: stage.index for stage in pipeline.stages for name in stage.variables}
    routes, params = {}, {}
    for info in request.capture.variables:
        stage = pipeline.stages[stage_of.get(info.name, 0)]
        routes[info.name] = _stage_route(info, stage_of, pipeline)
        params[info.name] = {"stage": stage.index, "ranks": stage.ranks}
    return strategy.Decisions(routes, params=params, section=pipeline)


def _stage_route(info, stage_of: dict, pipeline: Pipeline):
    stage = pipeline.stages[stage_of.get(info.name, 0)]
    if info.name not in stage_of:
        return ROUTE_STAGE, "no gradient reaches it from the loss: kept by stage 0, never updated"
    how = f"gradients averaged over its {pipeline.replicas} replicas" if pipeline.replicas > 1 else "one copy"
    return ROUTE_STAGE, (f"pipeline stage {stage.index} (staleness {pipeline.staleness[stage.index]}): trained by "
                         f"rank(s) {stage.ranks}, {how}")


def pipeline_split(capture, num_ranks: int, stages: Optional[int] = None, replicas: int = 1,
                   cuts: Optional[List[str]] = None, grad_scale: float = 1.0, schedule: str = "dsp") -> Pipeline:
    """DSP: K = `stages` consecutive stages (default: every rank, one pipeline) times `replicas`
    pipelines; the cuts balance the measured compute (balanced) unless named. `capture`: inspect_graph's."""
    if replicas < 1:
        raise ConfigError(f"--dsp_replicas must be >= 1, got {replicas}")
    if schedule == "locked" and replicas > 1:
        raise ConfigError("--dsp_schedule=locked (the baseline: one batch in the pipeline) runs one pipeline; "
                          "use --dsp_replicas=1")
    count = stages if stages else (len(cuts) + 1 if cuts else num_ranks // replicas)
    if count < 1 or count * replicas != num_ranks:
        raise ConfigError(f"--stages={count} x --dsp_replicas={replicas} = {count * replicas} rank(s), but the job has "
                          f"{num_ranks}: start stages x replicas ranks, or change --stages / --dsp_replicas")
    if cuts and len(cuts) != count - 1:
        raise ConfigError(f"--dsp_cuts names {len(cuts)} tensor(s) but --stages={count} needs {count - 1} "
                          "(one where each stage after the first begins)")
    batch_state = [s.name for s in capture.state if s.per_rank]
    if batch_state:
        raise ConfigError(f"--strategy dsp with model state computed from the batch ({batch_state[0]!r}, e.g. batch "
                          "norm): the recomputed forward would update it a second time from a stale batch; use "
                          "--strategy hybrid, or a model without batch statistics")
    found = capture.measured.get("pipeline")
    if found is None:
        raise ConfigError("--strategy dsp needs the pipeline cut points that inspection measures for it "
                          "(capture(measures=measurements('dsp')))")
    try:
        chosen = check_named(found, cuts) if cuts else balanced(found, count)
    except ValueError as err:
        names = ", ".join(p.name for p in found.points[:8]) or "none"
        raise ConfigError(f"--stages={count}: {err}. Cut points found: {names}"
                          f"{', ...' if len(found.points) > 8 else ''}; use fewer stages or name the cuts "
                          "with --dsp_cuts") from None
    costs = stage_costs(found, chosen)
    total = sum(costs) or 1.0
    bounds = [None] + chosen + [None]
    out = []
    for k in range(count):
        below, above = set(bounds[k].variables) if bounds[k] else set(), bounds[k + 1]
        mine = sorted((set(above.variables) if above else set(found.variables)) - below)
        entering = bounds[k]
        out.append(Stage(index=k, ranks=[p * count + k for p in range(replicas)], variables=mine,
                         compute_share=costs[k] / total, input=entering.name if entering else None,
                         input_shape=entering.shape if entering else [],
                         input_bytes_per_example=entering.bytes_per_example if entering else 0))
    return Pipeline(stages=out, replicas=replicas, grad_scale=grad_scale, schedule=schedule)
