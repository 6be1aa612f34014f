"""One rank of a benchmark run: trains --model with --strategy (parallax_tf's or a baseline)
and writes this rank's figures to --out/rank<r>.json. Started by tools.bench on a cluster."""
import json
import os
import sys
import time

import numpy as np
from absl import app, flags

import parallax_tf as ptf
from tools import baselines, link_counters
from tools.shared import model_and_input, flags_as_given

flags.DEFINE_string("bench_strategy", "hybrid", "a parallax_tf strategy or a baseline")
flags.DEFINE_string("out", None, "Directory for the per-rank JSON.")
flags.DEFINE_string("bench_runs", None, "A JSON list of runs made one after another in this job, each a list "
                    "of flags (--bench_strategy, --model, ...) for it alone: run i's figures go to --out/i/ "
                    "(tools.bench.run_in_one_job).")
FLAGS = flags.FLAGS


HELD_OUT_BATCHES = 32  # 1,024 cnn examples, the same ones for every strategy


def held_out_loss(model_fn, input_fn, variables) -> float:
    """Mean loss of the trained variables (whole, single-device names) on batches no rank
    trained on, in a plain single-device graph."""
    return held_out_losses(model_fn, input_fn, [variables])[0]


def held_out_losses(model_fn, input_fn, snapshots) -> list:
    """held_out_loss of each of several sets of values, in one graph."""
    import tensorflow as tf
    from parallax_tf.feeds import make_feeds
    from parallax_tf.inspect_graph import logical_name
    from parallax_tf.model import RunContext
    from parallax_tf.training_graph import call_model_fn
    graph = tf.Graph()
    with graph.as_default():
        loss = call_model_fn(model_fn, RunContext(0, 1, 0, 1, 0)).loss
        placeholders = [op.name for op in graph.get_operations() if op.type == "Placeholder"]
        feeds = [make_feeds(input_fn, RunContext(10_000 + i, 1, 0, 1, 0), placeholders, graph)
                 for i in range(HELD_OUT_BATCHES)]          # ranks no training run has
        out = []
        loaded = [(logical_name(v), v, tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape))
                  for v in tf.compat.v1.global_variables() if logical_name(v) in snapshots[0]]
        load = tf.group(*[v.assign(value) for _, v, value in loaded])
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run([tf.compat.v1.global_variables_initializer(), tf.compat.v1.tables_initializer()])
            for variables in snapshots:
                sess.run(load, {value: variables[name] for name, _, value in loaded})
                out.append(float(np.mean([sess.run(loss, f) for f in feeds])))
    return out


DIVERGED_EXIT = 3


def main(argv):
    if FLAGS.bench_runs:
        for i, given in enumerate(json.loads(FLAGS.bench_runs)):
            with flags_as_given(given):
                record = train_and_measure()
            os.makedirs(os.path.join(FLAGS.out, str(i)), exist_ok=True)
            with open(os.path.join(FLAGS.out, str(i), f"rank{record['rank']}.json"), "w") as f:
                json.dump(record, f)
        return
    try:
        record = train_and_measure()
    except ptf.Diverged as err:       # a result too: tools.straggler reports it
        record = {"rank": int(os.environ.get("HOROVOD_RANK", "0")), "diverged": str(err)}
    with open(os.path.join(FLAGS.out, f"rank{record['rank']}.json"), "w") as f:
        json.dump(record, f)
    if "diverged" in record:
        sys.exit(DIVERGED_EXIT)


def train_and_measure() -> dict:
    model_fn, input_fn = model_and_input(FLAGS.model)
    total = FLAGS.steps + FLAGS.warmup
    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    if FLAGS.bench_strategy in baselines.BASELINES:
        figures = baselines.run(FLAGS.bench_strategy, model_fn, input_fn, total,
                                profile_threads_from=FLAGS.warmup)
        reported, lower = None, None
    else:
        link = link_counters.LinkCounter(int(os.environ.get("HOROVOD_LOCAL_RANK", "0")))
        result = ptf.run(model_fn, input_fn, steps=total, strategy=FLAGS.bench_strategy, log_every=0,
                         profile_threads_from=FLAGS.warmup, hooks=[link])
        figures = {"thread_cpu_s_per_step": result.extras.get("thread_cpu_s_per_step", {}),
                   "pool_threads": result.extras.get("pool_threads"),
                   "step_times": result.step_times, "link_bytes": link.moved,
                   "examples_per_step": result.examples_per_step, "step_cpu_s": result.step_cpu_s}
        reported = float(sum(result.bytes_per_step.values()))
        figures["wall"] = {"train_start_unix": time.time() - result.wall_time_s, "wall_s": result.wall_time_s,
                           "global_step": result.global_step, "local_steps": len(result.step_times)}
        lower = result.lower_bound_bytes_per_step
        figures["bytes_by_route"] = result.bytes_per_step
        figures["losses"] = [float(x) for x in result.losses]
        if rank == 0:
            figures["held_out_loss"] = held_out_loss(model_fn, input_fn, result.variables)
    times = figures["step_times"][FLAGS.warmup:]
    # this process's CPU (all threads, serving its PS state too) per timed step
    cpu = figures["step_cpu_s"][FLAGS.warmup:]
    link = figures["link_bytes"]
    # the mean, not the median: a strategy that communicates every few steps (slim_dp rounds)
    # pays for it on those steps only
    record = {"rank": rank, "step_s": float(np.mean(times)), "examples_per_step": figures["examples_per_step"],
              "held_out_loss": figures.get("held_out_loss"), "bytes_by_route": figures.get("bytes_by_route"),
              "cpu_s_per_step": float(np.mean(cpu)) if cpu else None, **figures.get("wall", {}),
              "pool_threads": figures.get("pool_threads"),
              "losses": figures.get("losses"), "thread_cpu_s_per_step": figures.get("thread_cpu_s_per_step"),
              "reported_bytes_per_step": reported, "lower_bound_bytes_per_step": lower,
              # counters cover warm-up steps too: spread over all steps
              "link_bytes_per_step": {k: v / total for k, v in link.items()} if link else None}
    return record


if __name__ == "__main__":
    app.run(main)
