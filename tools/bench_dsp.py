"""DSP against locked model parallelism and data-parallel hybrid on one emulated cluster.

    python -m tools.bench_dsp --hosts 4 --bandwidth 1gbit --model mlp --mlp_features=256 \\
        --mlp_hidden=1024 --mlp_depth=4 --mlp_vocab=0 --mlp_batch=64 --steps 150 --json out/dsp.json

Every run trains --steps batches of the model's batch (--mlp_batch, ...): dsp with K = --hosts
stages (one per host), locked (--dsp_schedule=locked: the same stages and placement, one batch in
the pipeline at a time, plain backprop), hybrid on the same hosts with a per-rank batch of
batch / hosts (the same examples and the same number of updates). Then dsp and locked again
with host --slow_host given 1/2 of its CPU share (the stage on it runs 2x slower). Examples/s
are the run's examples over its wall time, filling and draining the pipeline included; held-out
loss on batches no run trained on. Prints a table, writes JSON and a PNG of the training loss
(moving mean of 10 batches) against examples and against wall time (batch i at i x the run's
mean time per batch)."""
from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np
from absl import app, flags

from parallax_tf import flags as ptf_flags  # noqa: F401  (--steps and the other run flags)
from tools import bench, cluster, shared  # noqa: F401  (cluster flags, --model, --json, --job_timeout_s)

flags.DEFINE_integer("slow_host", 1, "The host (stage) made 2x slower in the straggler runs (-1: no such runs).")
flags.DEFINE_list("runs", [], "Only these runs (labels of the table; default: all).")
flags.DEFINE_string("from_json", None, "Print the table and redraw the PNG of an earlier --json; run nothing.")
FLAGS = flags.FLAGS
SMOOTH = 10


def runs() -> dict:
    """label -> (strategy, extra flags, slow hosts)."""
    batch = batch_per_rank()
    hybrid_batch = [f"--{FLAGS.model}_batch={max(1, batch // FLAGS.hosts)}"]
    out = {"dsp": ("dsp", [], ""), "locked": ("dsp", ["--dsp_schedule=locked"], ""), "hybrid": ("hybrid", hybrid_batch, "")}
    if FLAGS.slow_host >= 0:
        slow = f"{FLAGS.slow_host}:2"
        out.update({"dsp slow stage": ("dsp", [], slow), "locked slow stage": ("dsp", ["--dsp_schedule=locked"], slow)})
    return {k: v for k, v in out.items() if not FLAGS.runs or k in FLAGS.runs}


def run_one(strategy: str, extra: list, slow: str) -> dict:
    out = tempfile.mkdtemp(prefix=f"bench-dsp-{strategy}-")
    job = [sys.executable, "-m", "tools.bench_job", f"--model={FLAGS.model}", f"--bench_strategy={strategy}",
           f"--steps={FLAGS.steps}", "--warmup=0", f"--out={out}", "--log_every=0",
           f"--timeout_s={FLAGS.job_timeout_s}"] + bench.model_flags() + extra
    cpu = {}
    status = cluster.run(job, FLAGS.hosts, 1, FLAGS.bandwidth, FLAGS.delay, timeout_s=FLAGS.job_timeout_s,
                         host_cpus=FLAGS.host_cpus, slow_hosts=slow, cpu_usage=cpu)
    if status != 0:
        return {"error": f"exit status {status}"}
    records = [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out))]
    chief = next(r for r in records if r["rank"] == 0)
    examples = FLAGS.steps * batch_per_rank()
    # CPU of the training loops alone (all threads of every rank, TF's and gRPC's included)
    train_cpu = sum(r["cpu_s_per_step"] * r["local_steps"] for r in records)
    return {"wall_s": chief["wall_s"], "examples": examples, "examples_per_s": examples / chief["wall_s"],
            "held_out_loss": chief["held_out_loss"], "losses": chief["losses"], "cpu_s_by_host": cpu,
            "train_cpu_s": train_cpu}


def batch_per_rank() -> int:
    from parallax_tf.model import RunContext
    _, input_fn = shared.model_and_input(FLAGS.model)
    return int(np.shape(next(iter(input_fn(RunContext()).values())))[0])


def table(results: dict) -> str:
    locked, hybrid = results.get("locked", {}), results.get("hybrid", {})
    rows = [["run", "examples/s", "vs locked", "vs hybrid", "wall s", "train CPU s", "cores busy", "held-out loss",
             "vs locked loss"]]
    for label, r in results.items():
        if "error" in r:
            rows.append([label, r["error"]] + [""] * 7)
            continue
        base = results.get("locked slow stage", locked) if label.endswith("slow stage") else locked
        rows.append([label, f"{r['examples_per_s']:,.0f}",
                     f"{r['examples_per_s'] / base['examples_per_s']:.2f}x" if "examples_per_s" in base else "-",
                     f"{r['examples_per_s'] / hybrid['examples_per_s']:.2f}x" if "examples_per_s" in hybrid else "-",
                     f"{r['wall_s']:.1f}", f"{r['train_cpu_s']:.1f}", f"{r['train_cpu_s'] / r['wall_s']:.2f}",
                     f"{r['held_out_loss']:.4f}",
                     f"{100 * (r['held_out_loss'] / base['held_out_loss'] - 1):+.1f}%" if "held_out_loss" in base else "-"])
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows)


def plot(results: dict, title: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (by_examples, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for label, r in results.items():
        if "error" in r or not r.get("losses"):
            continue
        losses = np.convolve(r["losses"], np.ones(SMOOTH) / SMOOTH, mode="valid")
        batches = np.arange(len(losses)) + SMOOTH
        per_batch = r["examples"] / len(r["losses"])
        by_examples.plot(batches * per_batch, losses, label=label)
        by_time.plot(batches * r["wall_s"] / len(r["losses"]), losses, label=label)
    for axis, xlabel in ((by_examples, "examples"), (by_time, "seconds (batch i at i x mean time per batch)")):
        axis.set_xlabel(xlabel)
        axis.set_ylabel(f"training loss (mean of {SMOOTH} batches)")
        axis.set_yscale("log")
        axis.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv):
    from parallax_tf.runtime import quiet
    quiet.apply(False)
    if FLAGS.from_json:
        saved = json.load(open(FLAGS.from_json))
        print(saved["title"])
        print(table(saved["results"]))
        plot(saved["results"], saved["title"], os.path.splitext(FLAGS.from_json)[0] + ".png")
        return
    results = {}
    for label, (strategy, extra, slow) in runs().items():
        print(f"bench_dsp: {label} ...", file=sys.stderr, flush=True)
        results[label] = run_one(strategy, extra, slow)
    title = (f"{FLAGS.model}: {FLAGS.hosts} hosts ({FLAGS.hosts} stages), {FLAGS.bandwidth}, {FLAGS.steps} batches "
             f"of {batch_per_rank()}")
    print(title)
    print(table(results))
    if FLAGS.json:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json)), exist_ok=True)
        with open(FLAGS.json, "w") as f:
            json.dump({"title": title, "results": results}, f, indent=1)
        plot(results, title, os.path.splitext(FLAGS.json)[0] + ".png")


if __name__ == "__main__":
    app.run(main)
