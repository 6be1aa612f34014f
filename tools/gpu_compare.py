"""Plain single-device TensorFlow against parallax_tf on one rank, model by model: examples/s and
how far apart the final variables are (the check tools/gpu_smoke.sh runs on a GPU machine).

    python -m tools.gpu_compare --models=lm,cnn --steps=100 [--warmup=10] [--json=PATH]

Each side runs in a child process of its own (a fresh TF runtime and GPU context each), from the
same initial values on the same batches. Other flags (--seed, --cnn_fc_units=..., --threads)
reach both children. Exit status 1 when an error exceeds --tolerance or a child fails."""
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import parallax_tf as ptf  # before TF (keeps its import-time logs quiet); registers --steps, --seed, --threads
import tensorflow as tf
from absl import app, flags

from parallax_tf import threads as pool_threads
from parallax_tf.feeds import batch_size, make_feeds
from parallax_tf.graph_walk import needed_placeholders
from parallax_tf.runtime import quiet
from parallax_tf.training_graph import call_model_fn
from tools.shared import model_and_input

flags.DEFINE_list("models", ["lm", "cnn"], "Reference models to compare.")
flags.DEFINE_float("tolerance", 1e-4, "Largest max|parallax_tf - single| / max|single| over variables that passes.")
flags.DEFINE_string("json", None, "Also write the figures here.")
flags.DEFINE_bool("deterministic", True, "Both sides with TF_DETERMINISTIC_OPS=1: GPU kernels that sum in a different "
                  "order each run (a sparse gradient's scatter-add) would otherwise make runs differ by more than "
                  "the tolerance; both are timed under it.")
flags.DEFINE_enum("mode", None, ["single", "parallax"], "Child process: train one side and write its results.")
flags.DEFINE_string("out", None, "Child process: path prefix of its results (.json, .npz).")
FLAGS = flags.FLAGS
FLAGS.set_default("warmup", 10)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rate(times, examples_per_step):
    """Examples/s over the steps after --warmup (None when none are left)."""
    timed = times[FLAGS.warmup:]
    return examples_per_step * len(timed) / sum(timed) if timed and sum(timed) > 0 else None


def _single(model_fn, input_fn):
    """What a user's single-device script does, with parallax_tf's thread pool size and seed."""
    quiet.apply(FLAGS.verbose)            # TF's deprecation notes, as parallax_tf.run silences them
    # parallax_tf's pool size: threads are no difference
    process = pool_threads.ProcessConfig(pool_threads.choose(FLAGS.threads, 1))
    graph, ctx = tf.Graph(), ptf.RunContext(0, 1, 0, 1, 0)
    with graph.as_default():
        # parallax_tf builds model_fn under this graph seed: ops seeded only by it (and op seeds,
        # which TF pairs with the graph seed) then draw the same values on both sides
        tf.compat.v1.set_random_seed(FLAGS.seed)
        model = call_model_fn(model_fn, ctx)
        train = model.train_op
        if train is None:
            with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
                train = model.optimizer.minimize(model.loss, global_step=tf.compat.v1.train.get_global_step())
        # (no device chosen in this process: memory grows as needed, parallax_tf.devices.configure)
        with tf.compat.v1.Session(graph=graph, config=process.proto()) as sess:
            sess.run([tf.compat.v1.global_variables_initializer(), tf.compat.v1.local_variables_initializer(),
                      tf.compat.v1.tables_initializer()])
            placeholders, times, examples = needed_placeholders(model.loss), [], 0
            for step in range(FLAGS.steps):
                ctx.step = step
                feeds = make_feeds(input_fn, ctx, placeholders, graph)
                begin = time.perf_counter()          # as parallax_tf times a step: the run, not input_fn
                sess.run([train, model.loss], feeds)
                times.append(time.perf_counter() - begin)
                examples = batch_size(feeds)
            values = sess.run({v.op.name: v for v in tf.compat.v1.global_variables()})
    return values, _rate(times, examples)


def _parallax(model_fn, input_fn):
    result = ptf.run(model_fn, input_fn, steps=FLAGS.steps, strategy="hybrid", log_every=0)
    return result.variables, _rate(result.step_times, result.examples_per_step)


def child() -> None:
    """One side (--mode) of one model (--model): its final variables and figures under --out."""
    values, rate = (_single if FLAGS.mode == "single" else _parallax)(*model_and_input(FLAGS.model))
    device = "GPU" if tf.config.list_physical_devices("GPU") else "CPU"
    print(f"{FLAGS.mode} {FLAGS.model}: {device}, examples/s {rate}", flush=True)
    np.savez(FLAGS.out + ".npz", **{name: np.asarray(v) for name, v in values.items()})
    with open(FLAGS.out + ".json", "w") as f:
        json.dump({"examples_per_s": rate, "device": device}, f)


def run_side(mode: str, name: str, workdir: str):
    """(figures, variables) of one child, or None when it failed."""
    out = os.path.join(workdir, f"{name}_{mode}")
    # the parent's own arguments go on (model sizes, --seed, --steps); the last value of a flag wins
    cmd = [sys.executable, "-m", "tools.gpu_compare", *sys.argv[1:], f"--mode={mode}", f"--model={name}",
           f"--out={out}"]
    env = dict(os.environ, **({"TF_DETERMINISTIC_OPS": "1"} if FLAGS.deterministic else {}))
    if subprocess.run(cmd, cwd=ROOT, env=env).returncode != 0:
        return None
    with open(out + ".json") as f, np.load(out + ".npz") as npz:
        return json.load(f), {k: npz[k] for k in npz.files}


def compare(single: dict, parallax: dict):
    """(max relative error, its variable) over parallax_tf's variables; inf for one `single` lacks."""
    missing = sorted(set(parallax) - set(single))
    if missing:
        return float("inf"), f"{missing} (not in the single-device run)"
    errors = {k: float(np.max(np.abs(parallax[k] - single[k]), initial=0.0) /
                       max(float(np.max(np.abs(single[k]), initial=0.0)), 1e-12)) for k in parallax}
    worst = max(errors, key=errors.get, default=None)
    return (errors[worst], worst) if worst else (0.0, None)


def _print(row: dict) -> None:
    rates = [f"{r:,.1f}" if r else "n/a" for r in (row["single_examples_per_s"], row["parallax_examples_per_s"])]
    ratio = f"{row['ratio']:.2f}" if row["ratio"] else "n/a"
    device = " / ".join(dict.fromkeys([row["device"], row["parallax_device"]]))   # "GPU / CPU": they differ
    print(f"\n{'model':<8}{'single ex/s':>14}{'parallax_tf ex/s':>18}{'ratio':>8}{'max rel. error':>16}  device\n"
          f"{row['model']:<8}{rates[0]:>14}{rates[1]:>18}{ratio:>8}{row['max_rel_error']:>16.3g}  {device}\n"
          f"  largest on {row['worst_variable']}: {'ok' if row['ok'] else 'FAIL'} (tolerance {FLAGS.tolerance:g})",
          flush=True)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.mode:
        return child()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_compare_") as workdir:
        for name in FLAGS.models:
            sides = [run_side(mode, name, workdir) for mode in ("single", "parallax")]
            if None in sides:
                print(f"{name}: a child process failed (its output is above)", flush=True)
                rows.append({"model": name, "ok": False, "failed": True})
                continue
            (single, single_values), (par, par_values) = sides
            error, worst = compare(single_values, par_values)
            rate_s, rate_p = single["examples_per_s"], par["examples_per_s"]
            rows.append({"model": name, "single_examples_per_s": rate_s, "parallax_examples_per_s": rate_p,
                         "ratio": rate_p / rate_s if rate_s and rate_p else None, "max_rel_error": error,
                         "worst_variable": worst, "device": single["device"], "parallax_device": par["device"],
                         "steps": FLAGS.steps, "warmup": FLAGS.warmup, "ok": error <= FLAGS.tolerance})
            _print(rows[-1])
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump({"tolerance": FLAGS.tolerance, "models": rows}, f, indent=2)
    sys.exit(0 if all(row["ok"] for row in rows) else 1)


if __name__ == "__main__":
    app.run(main)
