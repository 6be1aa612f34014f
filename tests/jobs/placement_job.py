"""Builds every rank's rewritten graph of a strategy on 2 hosts x 2 GPU ranks, places it as a
GPU job is placed (runtime.placement.settle), and writes what each op got, without running
anything: {"<strategy>": {"plan": ..., "ranks": [[[name, type, device], ...] per rank]}}.

usage: placement_job.py OUT_JSON"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import parallax_tf as ptf  # noqa: E402,F401  (registers the strategies)
import tensorflow as tf  # noqa: E402

from parallax_tf import strategy  # noqa: E402
from parallax_tf.inspect_graph import capture  # noqa: E402
from parallax_tf.model import RunContext  # noqa: E402
from parallax_tf.planner import PlanRequest, make_plan, measurements  # noqa: E402
from parallax_tf.runtime import placement  # noqa: E402
from parallax_tf.runtime.topology import Topology  # noqa: E402
from tests import cases  # noqa: E402

HOSTS, PER_HOST = 2, 2
RANKS = HOSTS * PER_HOST
BUILDS = {     # strategy -> (case, the strategy's options)
    "hybrid": ("mixed_adam", {}),
    "ps_plus": ("mixed_momentum", {}),
    "stanza": ("cnn_momentum", {"fc_nodes": 1}),
    "dsp": ("cnn_momentum", {"stages": 2, "replicas": 2}),
}


def build(name: str, device_type: str, only_rank=None) -> dict:
    case, options = BUILDS[name]
    _, model, optimizer, _ = cases.CASE_BY_NAME[case]
    model_fn, input_fn = cases.build(model, optimizer), cases.input_fn_for(model)
    captured = capture(model_fn, input_fn, RunContext(0, RANKS, 0, PER_HOST, 0), 0, **measurements(name))
    plan = make_plan(PlanRequest(captured, name, RANKS, HOSTS, options=options))
    ranks = []
    for rank in range(RANKS) if only_rank is None else [only_rank]:
        topo = Topology(rank=rank, size=RANKS, local_rank=rank % PER_HOST, local_size=PER_HOST, host=rank // PER_HOST,
                        ranks_per_host=[PER_HOST] * HOSTS, device_type=device_type)
        ctx = RunContext(rank, RANKS, rank % PER_HOST, PER_HOST, 0)
        graph = tf.Graph()
        with graph.as_default(), tf.device(topo.worker_device):
            strategy.get(plan.strategy).rewrite(strategy.BuildRequest(model_fn, ctx, plan, topo, 0))
        placement.settle(graph, topo.server_ranks, topo.device_type)
        ops = [[op.name, op.type, op.device] for op in graph.get_operations()]
        ops += [[f"{f.signature.name}/{node.name}", node.op, node.device]
                for f in graph.as_graph_def().library.function for node in f.node_def]
        ranks.append(ops)
    return {"plan": json.loads(plan.to_json()), "ranks": ranks}


def main(out_path: str) -> None:
    import horovod.tensorflow as hvd
    hvd.init()        # one process: the graphs' collectives are built, never run
    built = {name: build(name, "GPU") for name in BUILDS}
    built["hybrid_cpu"] = build("hybrid", "CPU", only_rank=1)
    with open(out_path, "w") as out:
        json.dump(built, out)


if __name__ == "__main__":
    main(sys.argv[1])
