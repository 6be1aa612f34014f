"""One rank of a benchmark run: trains --model with --strategy (parallax_tf's or a baseline)
and writes this rank's figures to --out/rank<r>.json. Started by tools.bench on a cluster."""
import json
import os

import numpy as np
from absl import app, flags

import parallax_tf as ptf
from tools import baselines
from tools.shared import model_and_input

flags.DEFINE_string("bench_strategy", "hybrid", "a parallax_tf strategy or a baseline")
flags.DEFINE_string("out", None, "Directory for the per-rank JSON.")
FLAGS = flags.FLAGS


def main(argv):
    model_fn, input_fn = model_and_input(FLAGS.model)
    total = FLAGS.steps + FLAGS.warmup
    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    if FLAGS.bench_strategy in baselines.BASELINES:
        figures = baselines.run(FLAGS.bench_strategy, model_fn, input_fn, total)
        reported, lower = None, None
    else:
        result = ptf.run(model_fn, input_fn, steps=total, strategy=FLAGS.bench_strategy, log_every=0)
        figures = {"step_times": result.step_times, "link_bytes": result.link_bytes,
                   "examples_per_step": result.examples_per_step, "cpu_s_per_step": result.cpu_s_per_step}
        reported = float(sum(result.bytes_per_step.values()))
        lower = result.lower_bound_bytes_per_step
    times = figures["step_times"][FLAGS.warmup:]
    link = figures["link_bytes"]
    record = {"rank": rank, "step_s": float(np.median(times)), "examples_per_step": figures["examples_per_step"],
              "cpu_s_per_step": figures.get("cpu_s_per_step"),
              "reported_bytes_per_step": reported, "lower_bound_bytes_per_step": lower,
              # counters cover warm-up steps too: spread over all steps
              "link_bytes_per_step": {k: v / total for k, v in link.items()} if link else None}
    with open(os.path.join(FLAGS.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    app.run(main)
