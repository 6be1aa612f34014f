"""`python -m tools.bench --sweep`: every strategy on a grid of emulated clusters, auto against
the best measured in each cell, and the cost model's prediction against the measurement.

    python -m tools.bench --sweep --sweep_hosts 2,4,8 --sweep_links 10mbit,100mbit,1gbit \\
        --sweep_models lm,cnn --sweep_rounds 2 --steps 40 --warmup 5 --json out/sweep.json

The prediction uses the calibration file (python -m tools.calibrate, separate runs) and a
compute time measured here in one process, never the run it is compared with. Prints one row
per cell and writes JSON and a heat-map PNG of auto / best beside it."""
from __future__ import annotations

import functools
import json
import os
import sys
from typing import Optional

from absl import flags

from parallax_tf import calibration, costmodel
from rewriters.stanza import cost as stanza_cost
from tools.shared import SWEEP_MODEL_FLAGS as MODEL_FLAGS

flags.DEFINE_bool("sweep", False, "Run the grid of --sweep_hosts x --sweep_links x --sweep_models instead of one "
                  "cluster.")
flags.DEFINE_list("sweep_hosts", ["2", "4", "8"], "Emulated hosts of the sweep's clusters.")
flags.DEFINE_list("sweep_links", ["10mbit", "100mbit", "1gbit"], "Link rates of the sweep's clusters.")
flags.DEFINE_list("sweep_models", ["lm", "cnn"], "Reference models of the sweep.")
flags.DEFINE_list("sweep_strategies", ["auto", "hybrid", "horovod", "tf_ps", "stanza"],
                  "Strategies and baselines run in every cell (stanza only where the model has an FC head).")
flags.DEFINE_integer("sweep_rounds", 2, "Runs of every strategy per cell, in alternation (auto, hybrid, ..., auto, "
                     "hybrid, ...); a cell compares their means. Runs of one plan on this rig differ by 10-20%.")
FLAGS = flags.FLAGS

# models with an FC head: stanza runs there, and auto may choose it (it is compared with stanza)
HEADED = {"cnn"}
PREDICTED = ("auto", "hybrid", "horovod")     # what the cost model describes (horovod: every variable AllReduce)


@functools.lru_cache(maxsize=None)
def _captured(model: str):
    """The model at the sweep's sizes, captured with a timed step (once per model)."""
    from tools.shared import capture_model
    return capture_model(model, MODEL_FLAGS[model], for_strategy="auto")   # timed, with the FC head


def predictions(model: str, hosts: int, link: str) -> dict:
    """Predicted step seconds of auto, hybrid and horovod on this cell, from a plan made here."""
    from parallax_tf.planner import PlanRequest, make_plan
    captured = _captured(model)
    cluster = costmodel.Cluster.calibrated(hosts, 1, costmodel.parse_rate(link), 0.0, cores=os.cpu_count(),
                                           calibration=calibration.load(FLAGS.calibration))
    loads, compute = costmodel.loads_from(captured), captured.compute_s or 0.0
    out = {}
    for strategy in PREDICTED:
        plan = make_plan(PlanRequest(captured, {"horovod": "allreduce"}.get(strategy, strategy), hosts, hosts,
                         cost_cluster=cluster, options={"stanza": True} if strategy == "auto" and model in HEADED
                         else None))
        if plan.section is not None:          # auto chose stanza
            fc, got = stanza_cost.choose_fc_nodes(loads, stanza_cost.layer_split_load(captured), cluster, compute)
        else:
            choices = {v.name: costmodel.Choice(v.route, max(1, v.partitions)) for v in plan.variables}
            got = costmodel.predict(loads, choices, cluster, compute)
        out[strategy] = got.step_s
    return out


def run_cell(run, model: str, hosts: int, link: str, strategies: list, rounds: int) -> dict:
    """`run(strategy, model, hosts, link, extra_flags)`: one measured run, as tools.bench's."""
    has_head = model in HEADED
    if rounds < 1:
        raise SystemExit(f"--sweep_rounds={rounds}: give 1 or more runs per strategy")
    strategies = [s for s in strategies if s != "stanza" or has_head]
    runs = {strategy: [] for strategy in strategies}
    # alternated, so that a slow spell of the machine falls on every strategy alike
    for round_ in range(rounds):
        for strategy in strategies:
            print(f"sweep: {model} {hosts} hosts {link}: {strategy} (run {round_ + 1}) ...", file=sys.stderr,
                  flush=True)
            extra = MODEL_FLAGS[model] + (["--auto_stanza"] if strategy == "auto" and has_head else [])
            runs[strategy].append(run(strategy, model, hosts, link, extra))
    return {"model": model, "hosts": hosts, "link": link, "results": {s: mean_of_runs(r) for s, r in runs.items()},
            "predicted_s": predictions(model, hosts, link)}


def mean_of_runs(runs: list) -> dict:
    """One strategy's runs in a cell as one result: the first run's figures with the mean step,
    rate and CPU per rank, and each run's rate; a failed run fails the strategy."""
    failed = next((r for r in runs if "error" in r), None)
    if failed is not None:
        return failed
    def mean(key):
        values = [r.get(key) for r in runs]
        return sum(values) / len(values) if all(values) else values[0]
    step_s = mean("step_s")
    return dict(runs[0], step_s=step_s, examples_per_s=runs[0]["examples_per_s"] * runs[0]["step_s"] / step_s,
                cpu_s_per_step_per_rank=mean("cpu_s_per_step_per_rank"),
                examples_per_s_each=[r["examples_per_s"] for r in runs])


def spread(cell: dict) -> Optional[float]:
    """The largest (fastest - slowest) / mean rate of one strategy's runs in the cell: how far
    apart runs of one plan were, next to which auto / best must be read."""
    spreads = [(max(each) - min(each)) / (sum(each) / len(each)) for r in cell["results"].values()
               for each in [r.get("examples_per_s_each")] if each and len(each) > 1]
    return max(spreads) if spreads else None


def judge(cell: dict) -> dict:
    """auto / best measured, and the cost model's error per predicted strategy."""
    ok = {name: r for name, r in cell["results"].items() if "error" not in r}
    best = max(ok, key=lambda n: ok[n]["examples_per_s"]) if ok else None
    auto = ok.get("auto", {}).get("examples_per_s")
    errors = {name: (cell["predicted_s"][name] - ok[name]["step_s"]) / ok[name]["step_s"]
              for name in PREDICTED if name in ok and name in cell["predicted_s"]}
    return {"best": best, "auto_vs_best": auto / ok[best]["examples_per_s"] if auto and best else None,
            "model_errors": errors}


def table(cells: list) -> str:
    names = list(dict.fromkeys(n for c in cells for n in c["results"]))
    header = ["model", "hosts", "link"] + [f"{n} ex/s" for n in names] + ["spread", "best", "auto/best"] + \
        [f"err {n}" for n in PREDICTED]
    rows = [header]
    for cell in cells:
        verdict = judge(cell)
        rate = {n: (f"{r['examples_per_s']:,.0f}" if "error" not in r else "failed") for n, r in cell["results"].items()}
        apart = spread(cell)
        rows.append([cell["model"], str(cell["hosts"]), cell["link"]] + [rate.get(n, "-") for n in names]
                    + [f"{apart * 100:.0f}%" if apart is not None else "-", verdict["best"] or "-",
                       f"{verdict['auto_vs_best']:.2f}" if verdict["auto_vs_best"] else "-"]
                    + [f"{verdict['model_errors'][n] * 100:+.0f}%" if n in verdict["model_errors"] else "-"
                       for n in PREDICTED])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


def heat_map(cells: list, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    rows = list(dict.fromkeys((c["model"], c["hosts"]) for c in cells))
    links = list(dict.fromkeys(c["link"] for c in cells))
    grid = np.full((len(rows), len(links)), np.nan)
    for cell in cells:
        ratio = judge(cell)["auto_vs_best"]
        if ratio is not None:
            grid[rows.index((cell["model"], cell["hosts"])), links.index(cell["link"])] = ratio
    fig, axis = plt.subplots(figsize=(2 + 1.6 * len(links), 1 + 0.5 * len(rows)))
    image = axis.imshow(grid, cmap="RdYlGn", vmin=0.5, vmax=1.0)
    for (i, j), value in np.ndenumerate(grid):
        axis.text(j, i, "-" if np.isnan(value) else f"{value:.2f}", ha="center", va="center")
    axis.set_xticks(range(len(links)), links)
    axis.set_yticks(range(len(rows)), [f"{m}, {h} hosts" for m, h in rows])
    axis.set_title("auto / best strategy measured (examples/s)")
    fig.colorbar(image)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(run_strategy) -> None:
    """`run_strategy`: tools.bench's (passed in: tools.bench runs as __main__)."""
    def run(strategy, model, hosts, link, extra_flags):
        return run_strategy(strategy, hosts, 1, link, "0ms", model, FLAGS.steps, FLAGS.warmup, FLAGS.job_timeout_s,
                            extra_flags=extra_flags)
    cells = []
    for model in FLAGS.sweep_models:
        if model not in MODEL_FLAGS:
            raise SystemExit(f"--sweep_models: unknown model {model!r}; choose from {', '.join(MODEL_FLAGS)}")
        for hosts in [int(h) for h in FLAGS.sweep_hosts]:
            for link in FLAGS.sweep_links:
                cells.append(run_cell(run, model, hosts, link, FLAGS.sweep_strategies, FLAGS.sweep_rounds))
                print(table(cells[-1:]), flush=True)
                if FLAGS.json:          # after every cell: a long sweep that stops keeps what it measured
                    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json)), exist_ok=True)
                    with open(FLAGS.json, "w") as f:
                        json.dump({"cells": cells, "calibration": calibration.path(FLAGS.calibration)}, f, indent=1)
    print(table(cells))
    if FLAGS.json:
        heat_map(cells, os.path.splitext(FLAGS.json)[0] + ".png")
