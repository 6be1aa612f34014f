"""Measures the cost model's machine constants on this machine and writes the file the planner
reads (parallax_tf.calibration; --calibration, else $PARALLAX_CALIBRATION, else
~/.cache/parallax_tf/calibration.json).

    python -m tools.calibrate      # lm and cnn on 2 and 8 emulated hosts, twice each: one job per host count

  rpc_overhead_s       wall time of one round trip to a parameter server: a worker session
                       reading a 4-byte variable on a PS task in another process, 300 times
  message_overhead_s   that PS process's CPU time per request it served (from /proc)
  task_cpu_s           CPU per PS task in another process a rank's step runs on: hybrid on
                       --cal_hosts emulated hosts with every table in 1 shard and in
                       --cal_hosts shards (a host's own task is in its first rank's process)
  serve_cpu_s          CPU per graph run a host's PS task serves (every rank's step runs one
                       there): the same runs, ranks whose host serves a shard against the rest
  peer_cpu_s           CPU per step per other rank: the runs on --cal_few_hosts and --cal_hosts
  received_cpu_s_per_byte  per byte a rank receives by allgather or PS (pulls, and the pushes
                       its host serves): --strategy=allreduce (every sparse gradient
                       allgathered) and hybrid on both host counts
  ring_cpu_s_per_byte  per byte a rank receives by ring AllReduce of dense gradients, and
  replica_cpu_s_per_byte  per byte of the dense variables it updates (whatever the ranks):
                       --cal_dense_model (every gradient dense) on both host counts, at its
                       own sizes and at --cal_small_dense's (a large dense model's CPU grows
                       with the ranks, a small one's hardly: the peer term is not the ring's)
  runtime_cpu_s        CPU one rank spends per step besides its model's compute
  master_cpu_s         more when the step runs through TF's gRPC master (plans with PS
                       variables; the others run in a session of their own process)
  exchange_cpu_s       the alltoall route's CPU per other rank (its exchanges' messages), and
  exchange_table_cpu_s its CPU per table on it: --strategy=collective of --model on both host
                       counts and of --cal_exchange_model (another number of tables) on
                       --cal_hosts
Each rank of each run is one equation (costmodel.host_cpu_terms): its CPU per step = its
model's compute (measured as the planner measures it) + runtime + peer x (ranks - 1) + master
(PS plans) + task x (PS tasks in other processes) + served x (graph runs its host's task
serves) + received x (its allgather and PS bytes) + ring x (its ring AllReduce bytes) +
replica x (bytes of its dense replicas) + exchange x (ranks - 1, with a table on the
alltoall route) + exchange_table x (its tables there). Twelve runs give 66 equations in ten terms (8 and 2
hosts): the least-squares fit with every term >= 0, each run weighing the same; each rank's
fitted figure is printed and kept beside its measured one. Every run is made --cal_repeats
times and its mean CPU taken (runs of one plan differ by 10-20% here); the runs of one host
count are made one after another in the same ranks (one start-up). --cal_refit fits the runs a
file holds again, measuring nothing.
These are separate runs from the ones tools.validate and tools.bench --sweep check the model on."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence

import numpy as np
from absl import app, flags

from parallax_tf import calibration as calibration_lib
from parallax_tf import costmodel
from parallax_tf import flags as ptf_flags  # noqa: F401  (--steps, --calibration, ...)
from tools import bench  # (also --host_cpus, --slow_hosts for its runs)
from tools import shared  # (also --model, --warmup)

flags.DEFINE_string("cal_dense_model", "cnn", "A model whose gradients are all dense: its allreduce runs on both "
                    "host counts separate the ring AllReduce's CPU per byte from the other bytes'.")
flags.DEFINE_string("cal_small_dense", " ".join(shared.SWEEP_MODEL_FLAGS["cnn"]), "Flags of a smaller "
                    "--cal_dense_model (the sweep's), run too on both host counts (space-separated; empty: not "
                    "run): a dense model's CPU grows with its ranks when it is large and not when it is small, "
                    "which only runs of both sizes tell apart.")
flags.DEFINE_string("cal_exchange_model", "recsys", "A model with another number of sparse tables than --model: "
                    "its collective run beside --model's separates the alltoall route's CPU per step from its CPU "
                    "per table.")
flags.DEFINE_integer("cal_hosts", 8, "Emulated hosts of the 1- and N-shard hybrid runs and an allreduce run.")
flags.DEFINE_integer("cal_few_hosts", 2, "Emulated hosts of the second 1-shard hybrid run and allreduce run, "
                     "which set how runtime CPU grows with the ranks (fewer than --cal_hosts).")
flags.DEFINE_string("cal_bandwidth", "1gbit", "Their link rate (fast: the runs measure CPU, not links).")
flags.DEFINE_integer("cal_round_trips", 300, "PS round trips timed.")
flags.DEFINE_bool("cal_refit", False, "Fit the constants again to the runs the calibration file's own "
                  "tools.calibrate measured (after a change to the cost model's terms), measuring nothing.")
flags.DEFINE_integer("cal_repeats", 2, "Times each run is made; its mean CPU per step enters the fit.", lower_bound=1)
FLAGS = flags.FLAGS

PS_SERVER = """
import sys, tensorflow as tf
spec = tf.train.ClusterSpec({"ps": [sys.argv[1]], "worker": [sys.argv[2]]})
tf.distribute.Server(spec, job_name="ps", task_index=0, start=True).join()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(pid: int) -> float:
    from parallax_tf.runtime.thread_cpu import stat_cpu_s
    with open(f"/proc/{pid}/stat") as f:
        return stat_cpu_s(f.read())


def measure_round_trips(count: int) -> dict:
    """(wall per round trip, PS CPU per request) through TF's gRPC runtime, PS in its own process."""
    import tensorflow as tf
    ps, worker = f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"
    server = subprocess.Popen([sys.executable, "-c", PS_SERVER, ps, worker],
                              env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    try:
        spec = tf.train.ClusterSpec({"ps": [ps], "worker": [worker]})
        local = tf.distribute.Server(spec, job_name="worker", task_index=0, start=True)
        graph = tf.Graph()
        with graph.as_default():
            with tf.compat.v1.device("/job:ps/task:0"):
                value = tf.compat.v1.get_variable("probe", [], initializer=tf.compat.v1.zeros_initializer())
            with tf.compat.v1.device("/job:worker/task:0"):
                read = tf.identity(value.read_value())
        config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=60_000)
        with tf.compat.v1.Session(local.target, graph=graph, config=config) as sess:
            sess.run(value.initializer)
            for _ in range(20):                      # connections and graph registration
                sess.run(read)
            cpu_before, began = _cpu_s(server.pid), time.perf_counter()
            for _ in range(count):
                sess.run(read)
            wall, cpu = time.perf_counter() - began, _cpu_s(server.pid) - cpu_before
        return {"rpc_overhead_s": wall / count, "message_overhead_s": cpu / count, "round_trips": count}
    finally:
        server.kill()
        server.wait(timeout=30)


TERMS = tuple(costmodel.CPU_TERMS)                       # runtime, peer, ..., ring, replica
FITTED = tuple(costmodel.CPU_TERMS.values())             # the Calibration field of each


def mean_of_repeats(got: list) -> dict:
    """CPU per step (the mean over ranks, and each rank's) and step time of repeated runs of one
    plan: each run's and the means."""
    cpu = [one["cpu_s_per_step_per_rank"] for one in got]
    return {"cpu_s_per_step": float(np.mean(cpu)), "cpu_s_per_step_each": cpu,
            "cpu_s_per_step_by_rank": np.mean([one["cpu_s_per_step_by_rank"] for one in got], axis=0).tolist(),
            "step_s": float(np.mean([one["step_s"] for one in got]))}


def column_scale(matrix: np.ndarray) -> np.ndarray:
    """Each column's largest magnitude (1 for a zero column): dividing by it puts byte counts and
    graph-run counts on one scale before a rank or least-squares solve."""
    scale = np.abs(matrix).max(axis=0)
    scale[scale == 0] = 1.0
    return scale


def nonnegative_fit(terms: list, beyond: list) -> np.ndarray:
    """The least-squares solution of terms x = beyond with every x >= 0 (each term is a cost):
    the best over every set of terms left free, the others 0 (ten terms: 1,023 small solves)."""
    a, b = np.array(terms, dtype=float), np.array(beyond, dtype=float)
    scale = column_scale(a)
    a = a / scale                                   # bytes and counts: columns of one magnitude
    best, best_residual = np.zeros(a.shape[1]), float(b @ b)
    for free in range(1, 2 ** a.shape[1]):
        columns = [j for j in range(a.shape[1]) if free >> j & 1]
        if np.linalg.matrix_rank(a[:, columns]) < len(columns):
            continue
        x = np.linalg.lstsq(a[:, columns], b, rcond=None)[0]
        residual = float(np.sum((a[:, columns] @ x - b) ** 2))
        if (x >= 0).all() and residual < best_residual - 1e-18:
            best, best_residual = np.zeros(a.shape[1]), residual
            best[columns] = x
    return best / scale


def measure_runtime_cpu(model: str, dense_model: str, hosts: int, few_hosts: int, bandwidth: str, steps: int,
                        warmup: int, repeats: int = 1, measured: Optional[dict] = None,
                        small_dense: Sequence[str] = (), exchange_model: str = "recsys") -> dict:
    """The CPU constants (see the module's doc) from runs of `model` (three hybrid, two
    allreduce, two collective), of `dense_model` (two allreduce, and two more at the sizes
    `small_dense` gives when it is not empty) and of `exchange_model` (one collective), each made
    `repeats` times: one equation per rank of each run. With `measured` (an earlier
    calibration's runs) their figures are fitted again instead."""
    from parallax_tf.planner import PlanRequest, make_plan
    from tools.shared import capture_model
    if not 1 < few_hosts < hosts:
        raise SystemExit(f"tools.calibrate: --cal_few_hosts={few_hosts} must be above 1 and below "
                         f"--cal_hosts={hosts}")
    # what each run's label stands for: a reference model and the flags of its sizes; the
    # compute each rank's CPU is counted beyond is the planner's own measure of it
    models = {model: (model, ()), dense_model: (dense_model, ()), exchange_model: (exchange_model, ())}
    if small_dense:
        models[f"{dense_model}_small"] = (dense_model, tuple(small_dense))
    captured = {label: capture_model(name, given, for_strategy="hybrid" if measured is None else None)
                for label, (name, given) in models.items()}
    if any(v.gradient == "sparse" for v in captured[dense_model].variables):
        raise SystemExit(f"tools.calibrate: --cal_dense_model={dense_model} has sparse gradients; name a model "
                         "whose gradients are all dense (cnn)")
    wanted = [("hybrid_1", "hybrid", hosts, 1, model), (f"hybrid_{hosts}", "hybrid", hosts, hosts, model),
              (f"hybrid_1_on_{few_hosts}", "hybrid", few_hosts, 1, model),
              ("allreduce", "allreduce", hosts, 1, model),
              (f"allreduce_on_{few_hosts}", "allreduce", few_hosts, 1, model),
              ("collective", "collective", hosts, 1, model),
              (f"collective_on_{few_hosts}", "collective", few_hosts, 1, model),
              (f"collective_{exchange_model}", "collective", hosts, 1, exchange_model),
              (f"allreduce_{dense_model}", "allreduce", hosts, 1, dense_model),
              (f"allreduce_{dense_model}_on_{few_hosts}", "allreduce", few_hosts, 1, dense_model)]
    if small_dense:
        wanted += [(f"allreduce_{dense_model}_small", "allreduce", hosts, 1, f"{dense_model}_small"),
                   (f"allreduce_{dense_model}_small_on_{few_hosts}", "allreduce", few_hosts, 1, f"{dense_model}_small")]
    got = {name: [] for name, *_ in wanted}
    if measured is None:
        # the runs of one host count in one job, made `repeats` times over (a run's CPU is the
        # steady steps' of its own ptf.run: the job's start-up is in none of them)
        for on_hosts in (hosts, few_hosts):
            mine = [w for w in wanted if w[2] == on_hosts] * repeats
            summaries = bench.run_in_one_job(
                [(strategy, models[of][0], list(models[of][1]) + ([f"--partitions={shards}"] * (strategy == "hybrid")))
                 for _, strategy, _, shards, of in mine], on_hosts, bandwidth, steps, warmup)
            for (name, strategy, _, _, of), one in zip(mine, summaries):
                if "error" in one:
                    raise SystemExit(f"tools.calibrate: {strategy} of {of} on {on_hosts} hosts ({name}) failed: "
                                     f"{one['error']}")
                got[name].append(one)
    runs = {}
    for name, strategy, on_hosts, shards, of in wanted:
        loads = costmodel.loads_from(captured[of])
        plan = make_plan(PlanRequest(captured[of], strategy, on_hosts, on_hosts, partitions=shards))
        choices = {v.name: costmodel.Choice(v.route, max(1, v.partitions)) for v in plan.variables}
        terms = costmodel.host_cpu_terms(loads, choices, costmodel.Cluster(on_hosts))
        if measured is not None:
            runs[name] = {**measured[name], "terms_by_rank": terms}
            continue
        # one rank per host: rank r is host r's first rank
        runs[name] = {"model": models[of][0], "model_flags": list(models[of][1]), "hosts": on_hosts,
                      "partitions": shards, "compute_s": captured[of].compute_s, "terms_by_rank": terms,
                      **mean_of_repeats(got[name])}

    # one equation per rank (module doc), many more than terms: least squares
    equations = [([terms[k] for k in TERMS], cpu - r["compute_s"])
                 for r in runs.values() for terms, cpu in zip(r["terms_by_rank"], r["cpu_s_per_step_by_rank"])]
    matrix = np.array([e[0] for e in equations])
    if np.linalg.matrix_rank(matrix / column_scale(matrix)) < len(TERMS):
        raise SystemExit(f"tools.calibrate: the runs on {few_hosts} and {hosts} hosts do not separate the CPU "
                         "terms (two of them move the same bytes, --model has no dense or no sparse gradient, or "
                         "--cal_exchange_model has as many sparse tables as --model); calibrate with --model=lm "
                         "--cal_dense_model=cnn --cal_exchange_model=recsys")
    # each run weighs the same, whatever its ranks (8 equations of one 8-host run, 2 of a 2-host one)
    weights = np.sqrt([1 / len(r["terms_by_rank"]) for r in runs.values() for _ in r["terms_by_rank"]])
    fit = nonnegative_fit((matrix * weights[:, None]).tolist(), (np.array([e[1] for e in equations]) * weights).tolist())
    for r in runs.values():
        r["fitted_cpu_s_by_rank"] = [r["compute_s"] + float(np.dot([t[k] for k in TERMS], fit))
                                     for t in r["terms_by_rank"]]
    return {**dict(zip(FITTED, (float(x) for x in fit))), "runs": runs, "model": model, "dense_model": dense_model,
            "exchange_model": exchange_model,
            "model_flags": bench.model_flags(), "small_dense": list(small_dense),
            "hosts": [few_hosts, hosts], "bandwidth": bandwidth, "steps": steps, "warmup": warmup, "repeats": repeats}


def earlier_runs(where: str) -> dict:
    """The round trips and runs an earlier tools.calibrate measured (for --cal_refit)."""
    try:
        with open(where) as f:
            measured = json.load(f)["measured"]
        usable = all("cpu_s_per_step_by_rank" in run for run in measured["cpu"]["runs"].values()) \
            and "exchange_model" in measured["cpu"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        usable = False
    if not usable:
        raise SystemExit(f"tools.calibrate --cal_refit: {where} holds no runs measured rank by rank, or none of "
                         "the alltoall route; run python -m tools.calibrate without --cal_refit")
    return measured


def main(argv):
    if FLAGS.cal_refit:
        earlier = earlier_runs(calibration_lib.path(FLAGS.calibration))
        trips, cpu = earlier["round_trips"], earlier["cpu"]
        if cpu.get("model_flags") != bench.model_flags():
            raise SystemExit(f"tools.calibrate --cal_refit: the runs were measured with {cpu.get('model_flags')}; "
                             f"give the same model flags (now {bench.model_flags()})")
        cpu = measure_runtime_cpu(cpu["model"], cpu["dense_model"], cpu["hosts"][1], cpu["hosts"][0], cpu["bandwidth"],
                                  cpu["steps"], cpu["warmup"], cpu["repeats"], measured=cpu["runs"],
                                  small_dense=cpu.get("small_dense", ()), exchange_model=cpu["exchange_model"])
    else:
        trips = measure_round_trips(FLAGS.cal_round_trips)
        cpu = measure_runtime_cpu(FLAGS.model, FLAGS.cal_dense_model, FLAGS.cal_hosts, FLAGS.cal_few_hosts,
                                  FLAGS.cal_bandwidth, FLAGS.steps, FLAGS.warmup, FLAGS.cal_repeats,
                                  small_dense=FLAGS.cal_small_dense.split(), exchange_model=FLAGS.cal_exchange_model)
    print(f"PS round trip: {trips['rpc_overhead_s'] * 1e6:.0f} us wall, {trips['message_overhead_s'] * 1e6:.0f} us "
          f"server CPU ({trips['round_trips']} reads)", flush=True)
    for name, run in cpu["runs"].items():
        each = " / ".join(f"{cpu_s * 1000:.1f}" for cpu_s in run["cpu_s_per_step_each"])
        ranks = " ".join(f"{measured * 1000:.1f}/{fitted * 1000:.1f}" for measured, fitted
                         in zip(run["cpu_s_per_step_by_rank"], run["fitted_cpu_s_by_rank"]))
        print(f"{name:>22}: {run['hosts']} hosts, {run['cpu_s_per_step'] * 1000:.1f} ms CPU per step per rank "
              f"({each}; compute {run['compute_s'] * 1000:.1f}); by rank measured/fitted {ranks}", flush=True)
    got = calibration_lib.Calibration(
        **{k: cpu[k] for k in FITTED},
        message_overhead_s=trips["message_overhead_s"], rpc_overhead_s=trips["rpc_overhead_s"],
        measured={"round_trips": trips, "cpu": {k: v for k, v in cpu.items() if k not in FITTED},
                  "cores": os.cpu_count(), "host": socket.gethostname(), "unix_time": time.time()})
    where = calibration_lib.save(got, FLAGS.calibration)
    print(f"wrote {where}: " + json.dumps({k: float(f"{v:.4g}") for k, v in got.constants().items()}), flush=True)


if __name__ == "__main__":
    app.run(main)
