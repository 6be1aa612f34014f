"""One rank of a benchmark run: trains --model with --strategy (parallax_tf's or a baseline)
and writes this rank's figures to --out/rank<r>.json. Started by tools.bench on a cluster."""
import json
import os
import resource
import sys
import time

import numpy as np
from absl import app, flags

import parallax_tf as ptf
from parallax_tf.plan import DYNAMIC_REPLICATED
from tools import baselines, link_counters
from tools.shared import model_and_input, flags_as_given

flags.DEFINE_string("bench_strategy", "hybrid", "a parallax_tf strategy or a baseline")
flags.DEFINE_string("out", None, "Directory for the per-rank JSON.")
flags.DEFINE_string("bench_runs", None, "A JSON list of runs made one after another in this job, each a list "
                    "of flags (--bench_strategy, --model, ...) for it alone: run i's figures go to --out/i/ "
                    "(tools.bench.run_in_one_job).")
flags.DEFINE_bool("tf2_form", False, "Train --model's TF2 form (models/tf2_forms.py) through ptf.run(train_step, "
                  "dataset) instead of its model_fn; with --shard_reading the dataset holds the ranks' own batches, "
                  "each rank reading its own as a model_fn's sharded input does.")
FLAGS = flags.FLAGS


HELD_OUT_BATCHES = 32  # 1,024 cnn examples, the same ones for every strategy


def held_out_loss(model_fn, input_fn, variables) -> float:
    """Mean loss of the trained variables (whole, single-device names) on batches no rank
    trained on, in a plain single-device graph."""
    return held_out_losses(model_fn, input_fn, [variables])[0]


def held_out_losses(model_fn, input_fn, snapshots, auc: bool = False) -> list:
    """held_out_loss of each of several sets of values, in one graph (dynamic tables hold what
    the values give them). With `auc`, (loss, AUC of predictions["probability"] against the
    "label" feed, or None) each."""
    import tensorflow as tf
    from parallax_tf import dynamic
    from parallax_tf.dynamic.state import DynamicState
    from parallax_tf.feeds import make_feeds
    from parallax_tf.inspect_graph import logical_name
    from parallax_tf.model import RunContext
    from parallax_tf.training_graph import call_model_fn
    graph = tf.Graph()
    with graph.as_default():
        model = call_model_fn(model_fn, RunContext(0, 1, 0, 1, 0))
        loss = model.loss
        probability = model.predictions.get("probability") if isinstance(model.predictions, dict) else None
        placeholders = [op.name for op in graph.get_operations() if op.type == "Placeholder"]
        tables = DynamicState(dynamic.tables(graph)) if dynamic.tables(graph) else None
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
                if tables is not None:
                    tables.load(sess, {k: v for k, v in variables.items() if k in set(tables.keys())})
                if not auc:
                    out.append(float(np.mean([sess.run(loss, f) for f in feeds])))
                    continue
                losses, scores, labels = [], [], []
                for f in feeds:
                    got = sess.run({"loss": loss, **({"p": probability} if probability is not None else {})}, f)
                    losses.append(got["loss"])
                    if "p" in got and "label" in {k.name.split(":")[0] for k in f}:
                        scores.append(got["p"])
                        labels.append(next(v for k, v in f.items() if k.name.split(":")[0] == "label"))
                out.append((float(np.mean(losses)), area_under_roc(np.concatenate(labels), np.concatenate(scores))
                            if scores else None))
    return out


def tf2_held_out_loss(model, input_fn) -> float:
    """held_out_loss of a TF2 form's model (models/tf2_forms.py), eagerly, on the same batches."""
    import tensorflow as tf
    from parallax_tf.model import RunContext
    return float(np.mean([float(tf.reduce_mean(model.losses({k: tf.constant(v) for k, v in
                                                              input_fn(RunContext(10_000 + i, 1, 0, 1, 0)).items()})))
                          for i in range(HELD_OUT_BATCHES)]))


def area_under_roc(labels, scores) -> float:
    """The probability that a random positive scores above a random negative (ties count half)."""
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    sorted_scores = np.asarray(scores)[order]
    i = 0
    while i < len(order):            # average ranks over ties
        j = i
        while j + 1 < len(order) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1
        i = j + 1
    positives = np.asarray(labels) > 0.5
    n_pos, n_neg = positives.sum(), (~positives).sum()
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)) if n_pos and n_neg else None


DIVERGED_EXIT = 3


def table_memory(result) -> dict:
    """What the embedding tables hold per parameter-server host at the end: a fixed table's
    shards (rows x row bytes, with each optimizer slot of the same shape), or a dynamic table's
    rows (values and slots) and its per-id counters (id, occurrences, last step, live: 32 B)."""
    plan = result.plan
    hosts = plan.num_hosts
    held = [0] * hosts
    for entry in plan.variables:
        if entry.route == "ps" and entry.gradient == "sparse":
            copies = 1 + sum(1 for k in result.variables if k.startswith(entry.name + "/") and
                             np.shape(result.variables[k]) == tuple(entry.shape))
            row_bytes = entry.bytes // max(1, entry.shape[0])
            for shard in entry.shards:
                held[shard.server] += (shard.row_end - shard.row_start) * row_bytes * copies
    rows_by_host = [0] * hosts
    for table in plan.dynamic_tables:
        ids = result.variables[f"{table.name}/ids"]
        copies = sum(1 for k, v in result.variables.items() if k.startswith(table.name + "/") and
                     np.ndim(v) == 2 and len(v) == len(ids))          # values and slots
        seen = result.variables[f"{table.name}/seen_ids"]
        if table.route == DYNAMIC_REPLICATED:     # every host holds the whole table (each of its ranks, a copy)
            spread = ([len(ids)] * hosts, [len(seen)] * hosts)
        else:
            spread = (_per_host(ids, table.shards, hosts), _per_host(seen, table.shards, hosts))
        for host, (rows, tracked) in enumerate(zip(*spread)):
            rows_by_host[host] += rows
            held[host] += rows * table.dim * 4 * copies + tracked * 32
    return {"embedding_bytes_by_host": held, "dynamic_rows_by_host": rows_by_host if plan.dynamic_tables else None}


def _per_host(ids, shards: int, hosts: int) -> list:
    """How many of `ids` each host holds (shard k on host k mod hosts, by the tables' owner rule)."""
    import tensorflow as tf
    from parallax_tf.dynamic.ids import owner
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        owners = sess.run(owner(tf.constant(np.asarray(ids, np.int64)), shards))
    return [int(np.sum(owners % hosts == host)) for host in range(hosts)]


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
        if "variables" in figures:        # Horovod's rank 0: its held-out loss beside parallax_tf's
            figures["held_out_loss"], figures["held_out_auc"] = held_out_losses(
                model_fn, input_fn, [figures.pop("variables")], auc=True)[0]
    else:
        link = link_counters.LinkCounter(int(os.environ.get("HOROVOD_LOCAL_RANK", "0")))
        trained, given = None, (model_fn, input_fn)
        if FLAGS.tf2_form:
            from models import tf2_forms
            trained, step, dataset = tf2_forms.step_and_dataset(FLAGS.model, tf2_forms.sizes_from_flags(FLAGS.model),
                                                                input_fn, total, ptf.size(), FLAGS.shard_reading)
            given = (step, dataset)
        result = ptf.run(*given, steps=total, strategy=FLAGS.bench_strategy, log_every=0,
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
        if rank == 0 and trained is not None:      # the TF2 model's own variables hold the trained values
            figures["held_out_loss"], figures["held_out_auc"] = tf2_held_out_loss(trained, input_fn), None
        elif rank == 0:
            figures["held_out_loss"], figures["held_out_auc"] = held_out_losses(
                model_fn, input_fn, [result.variables], auc=True)[0]
            figures.update(table_memory(result))
    times = figures["step_times"][FLAGS.warmup:]
    # this process's CPU (all threads, serving its PS state too) per timed step
    cpu = figures["step_cpu_s"][FLAGS.warmup:]
    link = figures["link_bytes"]
    # the mean, not the median: a strategy that communicates every few steps (slim_dp rounds)
    # pays for it on those steps only
    record = {"rank": rank, "step_s": float(np.mean(times)), "examples_per_step": figures["examples_per_step"],
              "held_out_loss": figures.get("held_out_loss"), "bytes_by_route": figures.get("bytes_by_route"),
              "held_out_auc": figures.get("held_out_auc"),
              "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "embedding_bytes_by_host": figures.get("embedding_bytes_by_host"),
              "dynamic_rows_by_host": figures.get("dynamic_rows_by_host"),
              "cpu_s_per_step": float(np.mean(cpu)) if cpu else None, **figures.get("wall", {}),
              "pool_threads": figures.get("pool_threads"),
              "losses": figures.get("losses"), "thread_cpu_s_per_step": figures.get("thread_cpu_s_per_step"),
              "reported_bytes_per_step": reported, "lower_bound_bytes_per_step": lower,
              # counters cover warm-up steps too: spread over all steps
              "link_bytes_per_step": {k: v / total for k, v in link.items()} if link else None}
    return record


if __name__ == "__main__":
    app.run(main)
