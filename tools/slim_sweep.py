"""Slim-DP over a grid of core/explore fractions, against hybrid, on one emulated cluster.

    python -m tools.slim_sweep --hosts 8 --bandwidth 100mbit --model cnn --steps 100 \\
        --cnn_label_noise 0.3 --fractions 0.1:0.02,0.1:0.08,0.02:0.16 --json out/slim_sweep.json

Every point trains the same model on the same batches; the table gives the dense variables'
bytes per step (and their ratio to hybrid's), examples/s and the held-out loss after the same
number of examples (and its gap to hybrid's). --error_feedback on,off runs every point with and
without --slim_error_feedback (default: on, the strategy's default). Writes JSON and a PNG (bytes
vs held-out loss) with --json."""
from __future__ import annotations

import json
import os
import sys

from absl import app, flags

from tools import bench

flags.DEFINE_list("fractions", ["0.1:0.02", "0.1:0.08", "0.05:0.13", "0.02:0.16", "0:0.18"],
                  "core:explore pairs (fractions of each dense variable).")
flags.DEFINE_list("error_feedback", ["on"], "Run every pair with error feedback on, off, or both (on,off).")
FLAGS = flags.FLAGS


def parse_fractions(specs) -> list:
    pairs = []
    for spec in specs:
        try:
            core, explore = (float(x) for x in spec.split(":"))
        except ValueError:
            raise app.UsageError(f"--fractions: {spec!r} is not core:explore (e.g. 0.1:0.02)")
        pairs.append((core, explore))
    return pairs


def sweep_points(pairs, error_feedback) -> list:
    """(label, flags) for every slim_dp run of the sweep; error_feedback: a list of "on"/"off"."""
    if not error_feedback or set(error_feedback) - {"on", "off"}:
        raise app.UsageError(f"--error_feedback: {','.join(error_feedback)!r}; give on, off or on,off")
    points = []
    for core, explore in pairs:
        for feedback in (mode == "on" for mode in error_feedback):
            label = f"core {core:g} explore {explore:g}" + ("" if feedback else " no EF")
            points.append((label, [f"--slim_core={core}", f"--slim_explore={explore}",
                                   f"--slim_error_feedback={str(feedback).lower()}"]))
    return points


def table(reference: dict, results: dict) -> str:
    ref_dense = bench.dense_bytes(reference.get("bytes_by_route") or {})
    ref_loss = reference.get("held_out_loss")
    rows = [["run", "examples/s", "dense B/step", "dense vs hybrid", "held-out loss", "loss vs hybrid"]]
    for label, r in [("hybrid", reference)] + list(results.items()):
        if "error" in r:
            rows.append([label, r["error"], "", "", "", ""])
            continue
        dense, loss = bench.dense_bytes(r.get("bytes_by_route") or {}), r.get("held_out_loss")
        rows.append([label, f"{r['examples_per_s']:,.0f}", bench.fmt_bytes(dense),
                     f"{dense / ref_dense:.3f}x" if dense is not None and ref_dense else "-",
                     f"{loss:.4f}" if loss is not None else "-",
                     f"{100 * (loss / ref_loss - 1):+.1f}%" if loss is not None and ref_loss else "-"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


def plot(reference: dict, results: dict, title: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axis = plt.subplots(figsize=(7, 4.5))
    done = {k: r for k, r in results.items() if "error" not in r}
    xs = [bench.dense_bytes(r["bytes_by_route"]) / 2**20 for r in done.values()]
    ys = [r["held_out_loss"] for r in done.values()]
    axis.scatter(xs, ys, color="tab:blue", label="slim_dp")
    for label, x, y in zip(done, xs, ys):
        axis.annotate(label.replace("core ", "c").replace(" explore ", "/e"), (x, y), fontsize=7,
                      textcoords="offset points", xytext=(4, 4))
    if "error" not in reference:
        axis.scatter([bench.dense_bytes(reference["bytes_by_route"]) / 2**20], [reference["held_out_loss"]],
                     color="tab:red", marker="s", label="hybrid (AllReduce)")
        axis.axhline(reference["held_out_loss"] * 1.02, color="tab:red", ls=":", lw=1, label="hybrid + 2%")
    axis.set_xscale("log")
    axis.set_xlabel("dense bytes per step per rank (MB, log)")
    axis.set_ylabel("held-out loss after the same examples")
    axis.set_title(title, fontsize=9)
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv):
    pairs = parse_fractions(FLAGS.fractions)
    run = lambda strategy, extra=(): bench.run_strategy(  # noqa: E731
        strategy, FLAGS.hosts, FLAGS.ranks_per_host, FLAGS.bandwidth, FLAGS.delay, FLAGS.model,
        FLAGS.steps, FLAGS.warmup, FLAGS.job_timeout_s, extra)
    print("slim_sweep: hybrid ...", file=sys.stderr, flush=True)
    reference = run("hybrid")
    results = {}
    for label, extra in sweep_points(pairs, FLAGS.error_feedback):
        print(f"slim_sweep: slim_dp {label} ...", file=sys.stderr, flush=True)
        results[label] = run("slim_dp", extra)
    print(table(reference, results))
    if FLAGS.json:
        info = {"hosts": FLAGS.hosts, "bandwidth": FLAGS.bandwidth, "model": FLAGS.model,
                "steps": FLAGS.steps, "warmup": FLAGS.warmup}
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json)), exist_ok=True)
        with open(FLAGS.json, "w") as f:
            json.dump({"cluster": info, "hybrid": reference, "slim_dp": results}, f, indent=1)
        title = (f"slim_dp vs hybrid: {FLAGS.model}, {FLAGS.hosts} hosts, {FLAGS.bandwidth}, "
                 f"{FLAGS.steps + FLAGS.warmup} steps")
        plot(reference, results, title, os.path.splitext(FLAGS.json)[0] + ".png")


if __name__ == "__main__":
    app.run(main)
