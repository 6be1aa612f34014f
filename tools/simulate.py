"""Cost-model predictions for 4-64 hosts, without running anything distributed.

    python -m tools.simulate --model lm --link_bandwidth 100mbit

Inspects the model once on this machine (single-device compute time, the FC head's alone,
bytes per variable, rows a batch touches), then predicts the step time of each strategy as the
cluster grows; stanza with the FC node count the cost model picks."""
from __future__ import annotations

from absl import app, flags

from parallax_tf import calibration, costmodel
from rewriters.stanza import cost as stanza_cost
from rewriters.stanza.measure import found_head
from parallax_tf import flags as ptf_flags  # noqa: F401  (--link_bandwidth, --link_delay, --seed)
from parallax_tf.costmodel import Choice
from parallax_tf.plan import ROUTE_ALLREDUCE, ROUTE_PS
from tools.shared import capture_model

flags.DEFINE_list("sim_hosts", ["4", "8", "16", "32", "48", "64"], "Cluster sizes to predict.")
flags.DEFINE_integer("sim_ranks_per_host", 1, "Ranks per host.")
FLAGS = flags.FLAGS
PAPER_48_HOST_SPEEDUP = 6.02    # Parallax (EuroSys'19): hybrid vs Horovod on LM1B, 48 GPUs


def strategy_choices(loads, cluster) -> dict:
    """What each strategy would do with every variable on this cluster."""
    return {
        "hybrid": costmodel.choose(loads, cluster, 0.0, routes={
            l.name: ROUTE_PS if l.gradient == "sparse" else ROUTE_ALLREDUCE for l in loads}),
        "horovod": {l.name: Choice(ROUTE_ALLREDUCE) for l in loads},
        "tf_ps": {l.name: Choice(ROUTE_PS, 1) for l in loads},
        "auto": costmodel.choose(loads, cluster, 0.0),
    }


def main(argv):
    captured = capture_model(FLAGS.model, for_strategy="auto")   # timed, with the FC head
    loads = costmodel.loads_from(captured)
    bandwidth = costmodel.parse_rate(FLAGS.link_bandwidth or "100mbit")
    delay = costmodel.parse_delay(FLAGS.link_delay or "0ms")
    found = found_head(captured)
    head = f" (FC head {found.compute_s * 1000:.1f}ms)" if found.compute_s else ""
    print(f"{FLAGS.model}: single-device compute {captured.compute_s * 1000:.1f}ms/step{head}, links "
          f"{FLAGS.link_bandwidth or '100mbit'}, delay {FLAGS.link_delay or '0ms'}; predicted step time (ms):")
    split = stanza_cost.layer_split_load(captured)
    names = ["hybrid", "horovod", "tf_ps", "auto"] + (["stanza"] if split else [])
    print("hosts  " + "  ".join(f"{n:>9}" for n in names) + "  hybrid/horovod" + ("  FC nodes" if split else ""))
    if not split:
        print(f"(no stanza column: {found.problem})")
    for hosts in [int(h) for h in FLAGS.sim_hosts]:
        cluster = costmodel.Cluster.calibrated(hosts, FLAGS.sim_ranks_per_host, bandwidth, delay,
                                               calibration=calibration.load(FLAGS.calibration))
        steps = {n: costmodel.predict(loads, c, cluster, captured.compute_s).step_s
                 for n, c in strategy_choices(loads, cluster).items()}
        fc_nodes = ""
        if split:
            fc, predicted = stanza_cost.choose_fc_nodes(loads, split, cluster, captured.compute_s)
            steps["stanza"], fc_nodes = predicted.step_s, f"  {fc:8d}"
            if stanza_cost.prefers_stanza(predicted.step_s, fc, steps["auto"], cluster.ranks):   # the planner's rule
                steps["auto"] = predicted.step_s
        print(f"{hosts:>5}  " + "  ".join(f"{steps[n] * 1000:9.1f}" for n in names)
              + f"  {steps['horovod'] / steps['hybrid']:13.2f}x" + fc_nodes
              + (f"   (Parallax paper, 48 GPUs: {PAPER_48_HOST_SPEEDUP}x)" if hosts == 48 else ""))


if __name__ == "__main__":
    app.run(main)
