"""Measures the cost model's machine constants on this machine and writes the file the planner
reads (parallax_tf.calibration; --calibration, else $PARALLAX_CALIBRATION, else
~/.cache/parallax_tf/calibration.json).

    python -m tools.calibrate                 # lm on 2 and 8 emulated hosts, twice each, ~6 minutes

  rpc_overhead_s       wall time of one round trip to a parameter server: a worker session
                       reading a 4-byte variable on a PS task in another process, 300 times
  message_overhead_s   that PS process's CPU time per request it served (from /proc)
  task_cpu_s           CPU per PS task in another process a rank's step runs on (the mean
                       over ranks: costmodel._ps_tasks): hybrid on --cal_hosts emulated
                       hosts with every table in 1 shard and in --cal_hosts shards
  peer_cpu_s           CPU per step per other rank: hybrid in 1 shard on --cal_few_hosts
                       and on --cal_hosts
  received_cpu_s_per_byte  per byte a rank's host receives (AllReduce, allgather, PS pulls
                       and the pushes it serves): --strategy=allreduce (every sparse gradient
                       allgathered) on both host counts
  runtime_cpu_s        CPU one rank spends per step besides its model's compute
  master_cpu_s         more when the step runs through TF's gRPC master (plans with PS
                       variables; the others run in a session of their own process)
Each run: CPU per step per rank = single-process CPU + runtime + peer x (ranks - 1) + master
(PS plans) + task x (PS tasks in other processes its step runs on) + received x (bytes its
host receives, costmodel.received_bytes); the five runs give five equations in the five constants, solved exactly.
Every run is made --cal_repeats times and its mean CPU taken (runs of one plan differ by 10-20%
here; an exact solve passes that on to the constants, magnified).
These are separate runs from the ones tools.validate and tools.bench --sweep check the model on."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

from parallax_tf import calibration as calibration_lib
from parallax_tf import costmodel
from parallax_tf import flags as ptf_flags  # noqa: F401  (--steps, --calibration, ...)
from tools import bench  # noqa: F401  (also --host_cpus, --slow_hosts for its runs)
from tools import shared  # noqa: F401  (--model, --warmup)

flags.DEFINE_integer("cal_hosts", 8, "Emulated hosts of the 1- and N-shard hybrid runs and an allreduce run.")
flags.DEFINE_integer("cal_few_hosts", 2, "Emulated hosts of the second 1-shard hybrid run and allreduce run, "
                     "which set how runtime CPU grows with the ranks (fewer than --cal_hosts).")
flags.DEFINE_string("cal_bandwidth", "1gbit", "Their link rate (fast: the runs measure CPU, not links).")
flags.DEFINE_integer("cal_round_trips", 300, "PS round trips timed.")
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


FITTED = ("runtime_cpu_s", "peer_cpu_s", "master_cpu_s", "task_cpu_s", "received_cpu_s_per_byte")


def equation_terms(run: dict) -> list:
    """What multiplies each of FITTED in a run's equation."""
    return [1.0, run["hosts"] - 1, run["master"], run["ps_tasks"], run["received_bytes"]]


def mean_of_repeats(got: list) -> dict:
    """CPU per step per rank and step time of repeated runs of one plan: each run's and the means."""
    cpu = [one["cpu_s_per_step_per_rank"] for one in got]
    return {"cpu_s_per_step": float(np.mean(cpu)), "cpu_s_per_step_each": cpu,
            "step_s": float(np.mean([one["step_s"] for one in got]))}


def measure_runtime_cpu(model: str, hosts: int, few_hosts: int, bandwidth: str, steps: int, warmup: int,
                        repeats: int = 1) -> dict:
    """The CPU constants (see the module's doc) from a single-process run, three hybrid runs and
    two allreduce runs, each made `repeats` times."""
    from parallax_tf.inspect_graph import capture
    from parallax_tf.model import RunContext
    from parallax_tf.planner import make_plan
    from tools.shared import model_and_input
    if not 1 < few_hosts < hosts:
        raise SystemExit(f"tools.calibrate: --cal_few_hosts={few_hosts} must be above 1 and below "
                         f"--cal_hosts={hosts}")
    model_fn, input_fn = model_and_input(model)
    captured = capture(model_fn, input_fn, RunContext(), FLAGS.seed)
    loads = costmodel.loads_from(captured)

    def repeated(what: str, strategy: str, on_hosts: int, extra_flags=()) -> dict:
        """CPU per step per rank and step time of `repeats` runs: each run's and their means."""
        got = []
        for _ in range(repeats):
            one = bench.run_strategy(strategy, on_hosts, 1, bandwidth, "0ms", model, steps, warmup,
                                     extra_flags=extra_flags)
            if "error" in one:
                raise SystemExit(f"tools.calibrate: {what} failed: {one['error']}")
            got.append(one)
        return mean_of_repeats(got)

    runs = {"single": repeated("the single-process run", "single", 1)}

    def run(name: str, strategy: str, on_hosts: int, shards: int = 1) -> dict:
        plan = make_plan(captured, strategy, on_hosts, on_hosts, partitions=shards)
        choices = {v.name: costmodel.Choice(v.route, max(1, v.partitions)) for v in plan.variables}
        got = repeated(f"{strategy} on {on_hosts} hosts ({name})", strategy, on_hosts,
                       [f"--partitions={shards}"] if strategy == "hybrid" else [])
        cluster = costmodel.Cluster(on_hosts)
        runs[name] = {"hosts": on_hosts, "partitions": shards,
                      "ps_tasks": costmodel._ps_tasks(loads, choices, cluster),
                      "master": int(costmodel.runs_through_master(loads, choices)),
                      "received_bytes": costmodel.received_bytes(loads, choices, cluster), **got}
        return runs[name]

    one_shard, spread = run("hybrid_1", "hybrid", hosts), run(f"hybrid_{hosts}", "hybrid", hosts, hosts)
    one_shard_few = run(f"hybrid_1_on_{few_hosts}", "hybrid", few_hosts)
    gathering, gathering_few = run("allreduce", "allreduce", hosts), run(f"allreduce_on_{few_hosts}", "allreduce",
                                                                        few_hosts)

    # one equation per run (module doc), as many runs as unknowns: solved exactly
    measured = [one_shard, spread, one_shard_few, gathering, gathering_few]
    terms = [equation_terms(r) for r in measured]
    beyond = [r["cpu_s_per_step"] - runs["single"]["cpu_s_per_step"] for r in measured]
    try:
        fit = dict(zip(FITTED, (float(x) for x in np.linalg.solve(np.array(terms), np.array(beyond)))))
    except np.linalg.LinAlgError:
        raise SystemExit(f"tools.calibrate: the runs on {few_hosts} and {hosts} hosts do not separate the CPU "
                         "terms (two of them move the same bytes, or the model has no dense or no sparse gradient); "
                         "calibrate with --model=lm") from None
    # noise can make a difference negative; the model needs costs, so they are floored at 0
    # and the raw figures stay in the file
    return {**{k: max(0.0, v) for k, v in fit.items()}, "fit": fit, "runs": runs, "model": model,
            "hosts": [few_hosts, hosts], "bandwidth": bandwidth, "steps": steps, "warmup": warmup, "repeats": repeats}


def main(argv):
    trips = measure_round_trips(FLAGS.cal_round_trips)
    print(f"PS round trip: {trips['rpc_overhead_s'] * 1e6:.0f} us wall, {trips['message_overhead_s'] * 1e6:.0f} us "
          f"server CPU ({trips['round_trips']} reads)", flush=True)
    cpu = measure_runtime_cpu(FLAGS.model, FLAGS.cal_hosts, FLAGS.cal_few_hosts, FLAGS.cal_bandwidth,
                              FLAGS.steps, FLAGS.warmup, FLAGS.cal_repeats)
    for name, run in cpu["runs"].items():
        where = f" on {run['hosts']} hosts, {run['ps_tasks']:.2f} PS task(s) in other processes, {run['received_bytes']:,.0f} B received" \
            if "hosts" in run else ""
        each = " / ".join(f"{cpu_s * 1000:.1f}" for cpu_s in run["cpu_s_per_step_each"])
        print(f"{name:>14}: {run['cpu_s_per_step'] * 1000:.1f} ms CPU per step per rank ({each}){where}", flush=True)
    got = calibration_lib.Calibration(
        **{k: cpu[k] for k in FITTED},
        message_overhead_s=trips["message_overhead_s"], rpc_overhead_s=trips["rpc_overhead_s"],
        measured={"round_trips": trips, "cpu": {k: v for k, v in cpu.items() if k not in FITTED},
                  "cores": os.cpu_count(), "host": socket.gethostname(), "unix_time": time.time()})
    where = calibration_lib.save(got, FLAGS.calibration)
    print(f"wrote {where}: " + json.dumps({k: float(f"{v:.4g}") for k, v in got.constants().items()}), flush=True)


if __name__ == "__main__":
    app.run(main)
