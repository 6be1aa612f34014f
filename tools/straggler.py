"""Asynchronous PS+ against synchronous training on one emulated cluster, with or without a
straggler: time (and examples) to reach a held-out loss.

    python -m tools.straggler --hosts 8 --bandwidth 100mbit --slow_hosts 7:4 --model mlp \\
        --steps 300 --json out/straggler.json

Every run trains the same model on the same cluster: --steps synchronous steps (every rank's
batch each), or --async_budget x --steps x ranks pushes (one rank's batch each) for the
asynchronous runs. Each writes a checkpoint every --curve_secs seconds; afterwards each
checkpoint's held-out loss is measured, giving loss against wall time since training began. A
run whose loss became NaN/Inf is reported as diverged, with its curve up to then. The target is
--target_loss, else 1.1x the held-out loss the synchronous run ends with. Prints a table,
writes JSON and a PNG of the curves."""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile

from absl import app, flags

from parallax_tf import flags as ptf_flags  # noqa: F401  (--steps and the other run flags)
from tools import bench, cluster, shared  # noqa: F401  (cluster flags, --model, --json, --job_timeout_s)

RUNS = {   # label -> (strategy, extra flags)
    "ps_plus": ("ps_plus", []),
    "async_plain": ("ps_plus", ["--staleness_lr=none"]),
    "hybrid": ("hybrid", []),
}
SYNC = "hybrid"
ASYNC = ("ps_plus",)

flags.DEFINE_list("runs", list(RUNS), f"Which of {', '.join(RUNS)} to run.")
flags.DEFINE_float("target_loss", None, "Held-out loss to reach (default: 1.1x the synchronous run's final).")
flags.DEFINE_float("async_budget", 2.0, "Asynchronous runs may use this many times the synchronous run's examples "
                   "(stale updates make less progress per example), so that they can reach the target within the run.")
flags.DEFINE_string("from_json", None, "Print the table and redraw the PNG of an earlier run's --json; run nothing.")
flags.DEFINE_float("curve_secs", 1.0, "Seconds between the checkpoints the loss curve is measured on.")
FLAGS = flags.FLAGS


def run_one(label: str) -> dict:
    strategy, extra = RUNS[label]
    out = tempfile.mkdtemp(prefix=f"straggler-{label}-")
    ckpt = os.path.join(out, "ckpt")
    ranks = FLAGS.hosts * FLAGS.ranks_per_host
    steps = int(FLAGS.steps * ranks * FLAGS.async_budget) if strategy in ASYNC else FLAGS.steps
    job = [sys.executable, "-m", "tools.bench_job", f"--model={FLAGS.model}", f"--bench_strategy={strategy}",
           f"--steps={steps}", "--warmup=0", f"--out={out}", "--log_every=0", f"--ckpt_dir={ckpt}",
           f"--ckpt_secs={FLAGS.curve_secs}", "--ckpt_keep=100000",
           # a slow host imports TensorFlow and builds its graph slowly too: let the others wait
           f"--timeout_s={FLAGS.job_timeout_s}"] + bench.model_flags() + extra
    cpu = {}
    status = cluster.run(job, FLAGS.hosts, FLAGS.ranks_per_host, FLAGS.bandwidth, FLAGS.delay,
                         timeout_s=FLAGS.job_timeout_s, host_cpus=FLAGS.host_cpus, slow_hosts=FLAGS.slow_hosts,
                         cpu_usage=cpu)
    records = [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out)) if f.endswith(".json")]
    diverged = [r["diverged"] for r in records if "diverged" in r]
    if diverged:
        # no rank says when training began: the first time-based checkpoint is one period in
        first = min((os.path.getmtime(os.path.join(ckpt, d)) for d in os.listdir(ckpt)), default=None) \
            if os.path.isdir(ckpt) else None
        return {"diverged": diverged[0], "examples_per_global_step": batch_per_rank() * (1 if strategy in ASYNC else ranks),
                "curve": loss_curve(ckpt, first - FLAGS.curve_secs) if first is not None else []}
    if status != 0:
        return {"error": f"exit status {status}"}
    chief = next(r for r in records if r["rank"] == 0)
    return {"curve": loss_curve(ckpt, chief["train_start_unix"]), "wall_s": chief["wall_s"],
            "global_step": chief["global_step"], "local_steps": {r["rank"]: r["local_steps"] for r in records},
            "step_s": {r["rank"]: r["step_s"] for r in records}, "held_out_loss": chief["held_out_loss"],
            "examples_per_global_step": batch_per_rank() * (1 if strategy in ASYNC else ranks), "cpu_s_by_host": cpu}


def batch_per_rank() -> int:
    import numpy as np
    from parallax_tf.model import RunContext
    _, input_fn = shared.model_and_input(FLAGS.model)
    return int(np.shape(next(iter(input_fn(RunContext()).values())))[0])


def loss_curve(ckpt_dir: str, start_unix: float) -> list:
    """[(seconds since training began, global step, held-out loss)] over the run's checkpoints."""
    from parallax_tf.checkpoint import CheckpointStore
    from tools.bench_job import held_out_losses
    points = []
    for entry in os.listdir(ckpt_dir):
        found = re.match(r"^step-(\d+)$", entry)
        if found:
            path = os.path.join(ckpt_dir, entry, "model")
            points.append((os.path.getmtime(path + ".index") - start_unix, int(found.group(1)), path))
    points.sort()
    model_fn, input_fn = shared.model_and_input(FLAGS.model)
    losses = held_out_losses(model_fn, input_fn, [CheckpointStore.load(p)[0] for _, _, p in points])
    return [(max(0.0, t), step, loss) for (t, step, _), loss in zip(points, losses)]


def reach(curve, target: float):
    """(seconds, global step) of the first point at or below the target, or (None, None)."""
    return next(((t, step) for t, step, loss in curve if loss <= target), (None, None))


def table(results: dict, target: float) -> str:
    sync = results.get(SYNC, {})
    sync_time = reach(sync["curve"], target)[0] if "curve" in sync else None
    header = ["run", "to target s", "examples to target", "vs sync", "global steps", "wall s", "final held-out",
              "step ms (fastest..slowest rank)"]
    rows = [header]
    for label, r in results.items():
        if "error" in r:
            rows.append([label, r["error"]] + [""] * (len(header) - 2))
            continue
        seconds, step = reach(r["curve"], target)
        best = min((loss for _, _, loss in r["curve"]), default=float("nan"))
        if "diverged" in r:
            rows.append([label, f"diverged (best {best:.4f})" if seconds is None else f"{seconds:.1f}, then diverged",
                         "-", "-", "-", "-", "nan", "-"])
            continue
        times = sorted(r["step_s"].values())
        examples = step * r["examples_per_global_step"] if step is not None else None
        rows.append([label, f"{seconds:.1f}" if seconds is not None else "not reached",
                     f"{examples:,}" if examples is not None else "-",
                     f"{sync_time / seconds:.2f}x" if seconds and sync_time else "-",
                     str(r["global_step"]), f"{r['wall_s']:.1f}", f"{r['held_out_loss']:.4f}",
                     f"{times[0] * 1000:.1f}..{times[-1] * 1000:.1f}"])
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows)


def plot(results: dict, target: float, title: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (by_time, by_examples) = plt.subplots(1, 2, figsize=(11, 4))
    tops = []
    for label, r in results.items():
        if "error" in r or not r["curve"]:
            continue
        t, steps, losses = zip(*r["curve"])
        label = f"{label} (diverged)" if "diverged" in r else label
        by_time.plot(t, losses, marker=".", label=label)
        by_examples.plot([s * r["examples_per_global_step"] for s in steps], losses, marker=".", label=label)
        if "diverged" not in r:
            tops.append(max(losses))
    for axis, xlabel in ((by_time, "seconds since training began"), (by_examples, "examples (all ranks)")):
        axis.axhline(target, color="grey", linestyle="--", linewidth=1)
        axis.set_xlabel(xlabel)
        axis.set_ylabel("held-out loss")
        axis.set_yscale("log")
        if tops:       # a diverged run would flatten every other curve
            axis.set_ylim(top=max(tops) * 3)
        axis.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv):
    from parallax_tf.runtime import quiet
    quiet.apply(False)
    unknown = sorted(set(FLAGS.runs) - set(RUNS))
    if unknown:
        raise app.UsageError(f"--runs: unknown {unknown}; choose from {', '.join(RUNS)}")
    if FLAGS.from_json:
        saved = json.load(open(FLAGS.from_json))
        print(saved["title"])
        print(table(saved["results"], saved["target"]))
        plot(saved["results"], saved["target"], saved["title"], os.path.splitext(FLAGS.from_json)[0] + ".png")
        return
    results = {}
    for label in FLAGS.runs:
        print(f"straggler: {label} ...", file=sys.stderr, flush=True)
        results[label] = run_one(label)
    finished = [r for r in results.values() if "held_out_loss" in r]
    if not finished:
        print("straggler: every run failed", file=sys.stderr)
        sys.exit(1)
    sync = results.get(SYNC, {})
    target = FLAGS.target_loss or 1.1 * (sync.get("held_out_loss") or min(r["held_out_loss"] for r in finished))
    title = (f"{FLAGS.model}: {FLAGS.hosts} hosts, {FLAGS.bandwidth}, "
             f"{'slow hosts ' + FLAGS.slow_hosts if FLAGS.slow_hosts else 'no straggler'}, target {target:.4f}")
    print(title)
    print(table(results, target))
    if FLAGS.json:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json)), exist_ok=True)
        with open(FLAGS.json, "w") as f:
            json.dump({"title": title, "target": target, "results": results}, f, indent=1)
        plot(results, target, title, os.path.splitext(FLAGS.json)[0] + ".png")


if __name__ == "__main__":
    app.run(main)
