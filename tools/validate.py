"""Checks the cost model against the emulated cluster: predicted vs measured step time.

    python -m tools.validate --model lm --val_hosts 2,4,8 --val_bandwidths 100mbit,1gbit

The compute term is measured once: a plain single-process TF step of the model (forward,
backward and update). Routes and shard counts come from the same plan the real run uses."""
from __future__ import annotations

import json

from absl import app, flags

from parallax_tf import calibration, costmodel
from parallax_tf import flags as ptf_flags  # noqa: F401  (--steps, --seed, ...)
from parallax_tf.costmodel import Choice
from parallax_tf.planner import PlanRequest, make_plan
from tools import bench
from tools.shared import capture_model

flags.DEFINE_list("val_hosts", ["2", "4", "8"], "Cluster sizes to measure.")
flags.DEFINE_list("val_bandwidths", ["100mbit", "1gbit"], "Link rates to measure.")
flags.DEFINE_list("val_strategies", ["hybrid"], "Strategies to validate.")
flags.DEFINE_string("val_json", None, "Write the cases here.")
FLAGS = flags.FLAGS


def plan_choices(captured, strategy: str, hosts: int, cluster) -> dict:
    plan = make_plan(PlanRequest(captured, strategy, hosts, hosts, cost_cluster=cluster))
    return {v.name: Choice(v.route, max(1, v.partitions)) for v in plan.variables}


def main(argv):
    captured = capture_model(FLAGS.model)
    loads = costmodel.loads_from(captured)
    single = bench.run_strategy("single", 1, 1, "", "", FLAGS.model, FLAGS.steps, FLAGS.warmup)
    compute = single["step_s"]
    import os
    cores = os.cpu_count() or 1
    print(f"{FLAGS.model}: measured single-process step {compute * 1000:.1f}ms; {cores} cores shared by all ranks")
    cases = []
    for bandwidth in FLAGS.val_bandwidths:
        for hosts in [int(h) for h in FLAGS.val_hosts]:
            cluster = costmodel.Cluster.calibrated(hosts, 1, costmodel.parse_rate(bandwidth), 0.0, cores=cores,
                                                   calibration=calibration.load(FLAGS.calibration))
            for strategy in FLAGS.val_strategies:
                predicted = costmodel.predict(loads, plan_choices(captured, strategy, hosts, cluster), cluster,
                                              compute)
                measured = bench.run_strategy(strategy, hosts, 1, bandwidth, "0ms", FLAGS.model, FLAGS.steps,
                                              FLAGS.warmup)
                if "error" in measured:
                    print(f"{strategy} {hosts} hosts {bandwidth}: {measured['error']}")
                    continue
                error = (predicted.step_s - measured["step_s"]) / measured["step_s"]
                case = {"strategy": strategy, "hosts": hosts, "bandwidth": bandwidth,
                        "predicted_ms": predicted.step_s * 1000, "measured_ms": measured["step_s"] * 1000,
                        "error": error, "compute_ms": predicted.compute_s * 1000,
                        "network_ms": predicted.network_s * 1000, "collective_ms": predicted.collective_s * 1000,
                        "latency_ms": predicted.latency_s * 1000,
                        "server_ms": predicted.server_s * 1000, "cpu_bound_ms": predicted.cpu_bound_s * 1000,
                        "cpu_ms_per_rank": (measured.get("cpu_s_per_step_per_rank") or 0) * 1000}
                cases.append(case)
                print(f"{strategy:>8} {hosts:>2} hosts {bandwidth:>7}: predicted {case['predicted_ms']:7.1f}ms "
                      f"(max(compute {case['compute_ms']:.1f} + PS network {case['network_ms']:.1f} + servers "
                      f"{case['server_ms']:.1f}, CPU bound {case['cpu_bound_ms']:.1f}) + collectives "
                      f"{case['collective_ms']:.1f} + latency {case['latency_ms']:.1f}), measured "
                      f"{case['measured_ms']:7.1f}ms, error {error * 100:+.0f}%; CPU per rank per step "
                      f"{case['cpu_ms_per_rank']:.1f}ms x {hosts} ranks on {cores} cores", flush=True)
    if FLAGS.val_json:
        with open(FLAGS.val_json, "w") as f:
            json.dump({"compute_ms": compute * 1000, "cores": cores, "cases": cases}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
