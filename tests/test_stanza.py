"""Stanza (--strategy stanza) on real ranks: conv nodes train the layers below the FC head, FC
nodes the head. Synchronous, so the result must equal single-device training on the
concatenation of the conv nodes' batches (batch norm in the extractor: the per-rank-statistics
rule); the plan finds the cut; models without a clean cut get one message; a lost FC node is
named."""
import dataclasses
import functools
import json
import os
import re
import tempfile

import numpy as np
import pytest
import tensorflow as tf

from parallax_tf.errors import ModelError
from parallax_tf.inspect_graph import capture
from parallax_tf.model import RunContext
from parallax_tf.plan import Plan
from parallax_tf.planner import PlanRequest, make_plan, measurements
from rewriters.stanza.measure import found_head
from tests import cases, launch, reference

CASES = [c[0] for c in cases.STANZA_CASES]
# micro-batches have their own batch statistics: no batch norm there (the planner refuses it)
MICRO_CASES = [c for c in CASES if cases.CASE_BY_NAME[c][1] not in cases.PER_RANK_BATCH_STATISTICS]


# (ranks, fc nodes, micro-batches, staggered sends) of each run; the runs of one rank count
# share a job (tests/jobs/several_runs.py), the shard-list model's run among the 3-rank ones
RUNS = [(3, 1, 1, False), (3, 1, 3, False), (2, 1, 1, False), (5, 2, 1, False), (5, 2, 1, True)]
SHARDS_RUN = "cnn_shards"


def run_cases(size: int, fc_nodes: int, microbatches: int = 1, staggered: bool = False) -> str:
    """The output dir of the run (size, fc_nodes, microbatches, staggered), made in its rank count's job."""
    return _job(size)[(size, fc_nodes, microbatches, staggered)]


@functools.lru_cache(maxsize=None)
def _job(size: int) -> dict:
    outs, given = {}, []
    for run in [r for r in RUNS if r[0] == size]:
        _, fc_nodes, microbatches, staggered = run
        outs[run] = tempfile.mkdtemp(prefix=f"ptf-stanza-{size}-{fc_nodes}-{microbatches}-{int(staggered)}-")
        given.append({"out": outs[run], "strategy": "stanza", "names": CASES if microbatches == 1 else MICRO_CASES,
                      "flags": [f"--fc_nodes={fc_nodes}", f"--stanza_microbatches={microbatches}",
                                f"--stanza_sends={'staggered' if staggered else 'together'}"]})
    if size == 3:
        outs[SHARDS_RUN] = tempfile.mkdtemp(prefix="ptf-stanza-shards-")
        given.append({"out": outs[SHARDS_RUN], "strategy": "stanza", "names": [SHARDS_RUN], "flags": ["--fc_nodes=1"]})
    proc = launch.run_ranks(size, ["tests/jobs/equivalence_job.py", f"--runs={json.dumps(given)}"])
    assert proc.returncode == 0, f"stanza job failed:\n{launch.tail(proc)}"
    return outs


def check(out: str, name: str, size: int, conv_nodes: int) -> None:
    _, model, optimizer, _ = cases.CASE_BY_NAME[name]
    if model in cases.PER_RANK_BATCH_STATISTICS:
        want = reference.train_per_rank_statistics(model, optimizer, conv_nodes)
    else:
        want = reference.train_single_device(model, optimizer, conv_nodes)
    ranks = [np.load(os.path.join(out, f"{name}.rank{r}.npz")) for r in range(size)]
    tolerance = 1e-4 if optimizer.endswith("adam") else 1e-5
    for var, value in want.items():
        got = ranks[0][f"var:{var}"]
        assert reference.relative_error(got, value) <= tolerance, (name, var, reference.relative_error(got, value))
        for other in ranks[1:]:           # conv and FC nodes hand back the same whole values
            np.testing.assert_array_equal(other[f"var:{var}"], got)
    assert sorted(k[4:] for k in ranks[0].files if k.startswith("var:")) == sorted(want)
    assert all(int(r["global_step"]) == cases.STEPS for r in ranks)


@pytest.mark.parametrize("name", CASES)
def test_one_fc_node_serving_two_conv_nodes(name):
    check(run_cases(3, 1), name, 3, 2)


@pytest.mark.parametrize("name", CASES)
def test_two_ranks_train_on_the_one_conv_node_batch(name):
    # FC nodes read no data: on 2 ranks a step is single-device training on rank 0's batch
    check(run_cases(2, 1), name, 2, 1)


@pytest.mark.parametrize("name", CASES)
def test_two_fc_nodes_each_serving_a_group(name):
    check(run_cases(5, 2), name, 5, 3)          # groups [0, 1] -> 3 and [2] -> 4: unequal shares


@pytest.mark.parametrize("name", CASES)
def test_staggered_sends_give_the_same_step(name):
    # one collective per position in a group: the second turn has a sender in group [0, 1] only
    out = run_cases(5, 2, staggered=True)
    check(out, name, 5, 3)
    assert Plan.from_json(str(np.load(os.path.join(out, f"{name}.rank0.npz"))["plan"])).section.staggered


@pytest.mark.parametrize("name", MICRO_CASES)
def test_micro_batches_give_the_same_step(name):
    # 4 examples per conv node in 3 micro-batches: 2, 1 and 1 rows cross separately
    check(run_cases(3, 1, 3), name, 3, 2)


def test_micro_batches_with_batch_norm_are_refused():
    from parallax_tf.errors import ConfigError
    with pytest.raises(ConfigError, match=r"--stanza_microbatches=2 with model state computed from the batch "
                                          r"\('sequential/bn/moving_mean', e.g. batch norm\)"):
        _plan(cases.build("cnn_bn", "momentum"), cases.input_fn_for("cnn_bn"), microbatches=2)


def test_micro_batches_with_metrics_are_refused():
    from parallax_tf.errors import ConfigError
    build = cases.build("cnn", "momentum")

    def with_metrics(ctx):
        model = build(ctx)
        return dataclasses.replace(model, metrics={"loss_again": model.loss})
    with pytest.raises(ConfigError, match=r"--stanza_microbatches=2 with Model\(metrics=...\) \('loss_again'\): the "
                                          r"FC node computes the metrics on the batch it receives whole"):
        _plan(with_metrics, cases.input_fn_for("cnn"), microbatches=2)
    assert _plan(with_metrics, cases.input_fn_for("cnn")).section.microbatches == 1


def test_an_input_fn_over_a_shard_list_is_called_on_conv_nodes_only():
    """input_fn = lambda ctx: SHARDS[ctx.rank] with two shards at --np 3: the FC node (rank 2)
    never calls it, inspection included."""
    check(_job(3)[SHARDS_RUN], "cnn_shards", 3, conv_nodes=2)


def _plan(model_fn, input_fn, ranks=3, **stanza):
    captured = capture(model_fn, input_fn, RunContext(), 0, measures=measurements("stanza")["measures"])
    return make_plan(PlanRequest(captured, "stanza", ranks, 1, options={"fc_nodes": 1, **stanza}))


def test_plan_finds_the_cut_and_names_the_nodes():
    plan = _plan(cases.build("cnn", "momentum"), cases.input_fn_for("cnn"), ranks=4,
                 fc_nodes=2, microbatches=2)
    routes = {v.name: v.route for v in plan.variables}
    assert {n for n, r in routes.items() if r == "fc_node"} == {"fc1/kernel", "fc1/bias", "fc2/kernel", "fc2/bias"}
    assert routes["conv/kernel"] == routes["conv/bias"] == "allreduce"
    split = plan.section
    assert split.conv_ranks == [0, 1] and split.fc_ranks == [2, 3] and split.groups == [[0], [1]]
    assert [(t.name, t.shape, t.kind, t.bytes_per_example) for t in split.cut] == \
        [("Reshape:0", [36], "activation", 144), ("labels:0", [], "data", 8)]
    table = plan.table()
    assert "cut: Reshape:0 [36] float32 144B per example (activation)" in table
    assert "rank 2 serves [0]; rank 3 serves [1]; 2 micro-batches per step" in table
    assert Plan.from_json(plan.to_json()) == plan


def test_plan_staggers_sends_where_together_they_would_overflow_the_fc_nodes_port():
    from parallax_tf import costmodel
    from parallax_tf.errors import ConfigError
    captured = capture(cases.build("cnn", "momentum"), cases.input_fn_for("cnn"), RunContext(), 0, **measurements("stanza"))
    burst = 2 * cases.BATCH * 144              # two conv nodes' activations (144 B per example) at once
    queue_holds = lambda n: costmodel.Cluster(1, bandwidth_bytes_per_s=n / costmodel.PORT_QUEUE_S)  # noqa: E731

    def staggered(cluster, ranks=3, **stanza):
        return make_plan(PlanRequest(captured, "stanza", ranks, 1, cost_cluster=cluster,
                         options={"fc_nodes": 1, **stanza})).section.staggered
    assert staggered(queue_holds(burst - 1)) and not staggered(queue_holds(burst))
    assert not staggered(queue_holds(burst - 1), microbatches=2)      # half the burst each time
    assert not staggered(queue_holds(burst - 1), ranks=2)             # one conv node: nothing to stagger
    assert not staggered(queue_holds(burst - 1), sends="together")
    assert staggered(queue_holds(10 * burst), sends="staggered")
    plan = make_plan(PlanRequest(captured, "stanza", 3, 1, cost_cluster=queue_holds(burst - 1)))
    assert "conv nodes send one at a time (staggered)" in plan.table()
    assert (f"sends: staggered: 2 conv node(s) send {burst / 1024:.1f}KB at once, the FC node's port queues "
            f"{(burst - 1) / 1024:.1f}KB") in plan.table()
    assert Plan.from_json(plan.to_json()) == plan
    with pytest.raises(ConfigError, match=r"--stanza_sends=sometimes: choose auto, together or staggered"):
        staggered(None, sends="sometimes")


def test_cost_model_prices_an_overflowing_port_and_staggering():
    # 7 conv nodes x 32 x 8 KB = 1.8 MB arriving at once: over a 10 Mbit port's queue (250 KB),
    # under a 100 Mbit one's (2.5 MB)
    from parallax_tf import costmodel
    from rewriters.stanza import cost as stanza_cost
    loads, split = _fc_heavy_loads(head_bytes=4096)
    slow, fast = (costmodel.Cluster(8, bandwidth_bytes_per_s=rate / 8) for rate in (10e6, 100e6))
    assert stanza_cost.staggers(7, 32 * 8192, slow) and not stanza_cost.staggers(7, 32 * 8192, fast)
    predict = functools.partial(stanza_cost.predict_stanza, loads, split, compute_s=0.1, fc_nodes=1)
    together, staggered = predict(cluster=slow, staggered=False), predict(cluster=slow, staggered=True)
    assert predict(cluster=slow).step_s == staggered.step_s
    # together: a retransmission timeout each way; staggered: 7 collectives each way, not 1
    assert together.latency_s - staggered.latency_s == pytest.approx(
        2 * stanza_cost.TCP_RTO_MIN_S - 2 * 6 * (slow.rpc_overhead_s + 2 * slow.delay_s))
    assert predict(cluster=fast).step_s == predict(cluster=fast, staggered=False).step_s


def test_keras_batch_norm_state_stays_with_the_conv_nodes():
    plan = _plan(cases.build("cnn_bn", "momentum"), cases.input_fn_for("cnn_bn"))
    by_name = {v.name.replace("sequential/", ""): v for v in plan.variables}
    assert by_name["bn/moving_mean"].route == "local" and by_name["bn/moving_mean"].params["ranks"] == [0, 1]
    assert by_name["dense/kernel"].route == "fc_node" and by_name["dense_1/kernel"].route == "fc_node"
    assert by_name["bn/gamma"].route == "allreduce"
    assert [t.name for t in plan.section.cut] == ["sequential/flatten/Reshape:0", "labels:0"]


def _interleaved():
    """conv -> FC -> reshape -> conv: the FC layer feeds the feature extractor."""
    images = tf.compat.v1.placeholder(tf.float32, [None, 4, 4, 1], name="images")
    labels = tf.compat.v1.placeholder(tf.int64, [None], name="labels")
    k1 = tf.compat.v1.get_variable("k1", [3, 3, 1, 2])
    x = tf.reshape(tf.nn.conv2d(images, k1, 1, "SAME"), [-1, 32])
    w = tf.compat.v1.get_variable("w", [32, 16])
    x = tf.reshape(tf.matmul(x, w), [-1, 4, 4, 1])
    k2 = tf.compat.v1.get_variable("k2", [3, 3, 1, 3])
    logits = tf.reduce_mean(tf.nn.conv2d(x, k2, 1, "SAME"), axis=[1, 2])
    import parallax_tf as ptf
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    return ptf.Model(loss=loss, optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))


def _shared_weight():
    """One bias added in the extractor and in the head."""
    x = tf.compat.v1.placeholder(tf.float32, [None, 4, 4, 1], name="images")
    labels = tf.compat.v1.placeholder(tf.int64, [None], name="labels")
    k = tf.compat.v1.get_variable("k", [3, 3, 1, 1])
    b = tf.compat.v1.get_variable("b", [1])
    w = tf.compat.v1.get_variable("w", [16, 3])
    h = tf.reshape(tf.nn.conv2d(x, k, 1, "SAME") + b, [-1, 16])
    logits = tf.matmul(h, w) + b
    import parallax_tf as ptf
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    return ptf.Model(loss=loss, optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))


def _images(ctx):
    rng = np.random.RandomState(ctx.step)
    return {"images": rng.randn(2, 4, 4, 1).astype(np.float32), "labels": np.array([0, 1])}


@pytest.mark.parametrize("model_fn,input_fn,message", [
    (_interleaved, _images,
     r"the conv layer 'k2' comes after a fully connected layer: the FC layers are interleaved"),
    (_shared_weight, _images, r"variable 'b' is used both inside the FC head .* and before it"),
    (cases.build("sparse_only", "adam"), cases.input_fn_for("sparse_only"),
     r"the model has no fully connected layer on the way to the loss"),
    (cases.build("tfdata", "momentum"), None,       # tf.data batches of a fixed size
     r"tensor 'Mean:0' entering the FC head has a fixed batch dimension \(4\)"),
])
def test_no_clean_cut_is_one_clear_message(model_fn, input_fn, message):
    with pytest.raises(ModelError, match=r"--strategy stanza: " + message):
        _plan(model_fn, input_fn)


def test_fc_node_count_is_checked():
    from parallax_tf.errors import ConfigError
    with pytest.raises(ConfigError, match=r"--fc_nodes=3 with 3 rank\(s\)"):
        _plan(cases.build("cnn", "sgd"), cases.input_fn_for("cnn"), ranks=3, fc_nodes=3)
    with pytest.raises(ConfigError, match=r"--fc_nodes=3 exceeds the 2 conv node"):
        _plan(cases.build("cnn", "sgd"), cases.input_fn_for("cnn"), ranks=5, fc_nodes=3)


def test_a_killed_fc_node_is_named():
    out = tempfile.mkdtemp(prefix="ptf-stanza-kill-")
    proc = launch.run_ranks(1, ["tests/jobs/train_case.py", "--np=3", "--case=cnn_momentum", f"--out={out}",
                                "--strategy=stanza", "--steps=400", "--log_every=0", "--die_at_step=4",
                                "--die_rank=2", "--die_trigger_rank=0"], launcher="python", timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "rank 2 on localhost exited with status 137; stopping the other ranks" in output
    assert re.search(r"parallax_tf rank [01]: .*lost: rank 2 \(", output), launch.tail(proc)
    assert not [f for f in os.listdir(out) if f.endswith(".npz")]


def test_activation_bytes_are_what_crosses_the_cut():
    # cnn's cut: 36 float32 activations (144 B) and an int64 label (8 B) per example; each conv
    # node sends BATCH examples and receives the activations' gradient; the FC node both for two
    out = run_cases(3, 1)
    per_conv_node = cases.BATCH * (144 + 8) + cases.BATCH * 144
    moved = [json.loads(str(np.load(os.path.join(out, f"cnn_momentum.rank{r}.npz"))["route_bytes"])) for r in range(3)]
    assert [m["activations"] for m in moved] == [per_conv_node, per_conv_node, 2 * per_conv_node]
    assert moved[0]["allreduce"] > 0 and moved[0]["allreduce"] == moved[1]["allreduce"]


def _fc_heavy_loads(head_bytes=100 * 2**20, extractor_bytes=2**20):
    from parallax_tf import costmodel
    from rewriters.stanza import cost as stanza_cost
    loads = [costmodel.Load("conv", extractor_bytes, "dense", 0, 1), costmodel.Load("fc", head_bytes, "dense", 0, 1)]
    return loads, stanza_cost.LayerSplitLoad(head={"fc"}, activation_bytes=8192, data_bytes=8, batch=32,
                                           head_compute_s=0.05)


def test_cost_model_prefers_stanza_for_an_fc_heavy_model_on_slow_links():
    from parallax_tf import costmodel
    from rewriters.stanza import cost as stanza_cost
    from parallax_tf.plan import ROUTE_ALLREDUCE
    loads, split = _fc_heavy_loads()
    slow = costmodel.Cluster(8, bandwidth_bytes_per_s=100e6 / 8)
    horovod = costmodel.predict(loads, {l.name: costmodel.Choice(ROUTE_ALLREDUCE) for l in loads}, slow, 0.1).step_s
    fc_nodes, stanza = stanza_cost.choose_fc_nodes(loads, split, slow, 0.1)
    assert fc_nodes == 1                       # a second FC node would have to sum 100 MB with the first
    assert stanza.step_s < horovod / 10
    # the FC node's link carries 7 conv nodes' activations (8 KB per example, 32 each) both ways
    assert stanza.collective_s >= 2 * 7 * 32 * 8192 / slow.bandwidth_bytes_per_s
    fast = costmodel.Cluster(8, bandwidth_bytes_per_s=10e9 / 8)
    assert stanza_cost.predict_stanza(loads, split, fast, 0.1, 1).step_s < stanza.step_s


def test_auto_compares_stanza_per_batch_trained_not_per_step():
    # a stanza step trains N - F batches, a data-parallel step N (the cnn on 2 hosts at 1 Gbit ran
    # stanza at the same step time as hybrid and half its examples/s)
    from parallax_tf import costmodel
    from rewriters.stanza import cost as stanza_cost
    assert not stanza_cost.prefers_stanza(0.7, 1, 1.0, 2)       # 0.7 s per batch vs 0.5
    assert stanza_cost.prefers_stanza(0.45, 1, 1.0, 2)
    assert stanza_cost.prefers_stanza(0.8, 1, 1.0, 8)           # 0.114 vs 0.95 x 0.125 = 0.119
    assert not stanza_cost.prefers_stanza(0.85, 1, 1.0, 8)      # 0.121
    loads, split = _fc_heavy_loads(head_bytes=4096)
    split.head_compute_s = 0.5
    cluster = costmodel.Cluster(8, bandwidth_bytes_per_s=1e9 / 8)
    fc_nodes, chosen = stanza_cost.choose_fc_nodes(loads, split, cluster, 0.6)
    for other in range(1, 5):
        step = stanza_cost.predict_stanza(loads, split, cluster, 0.6, other).step_s
        assert chosen.step_s / (8 - fc_nodes) <= step / (8 - other)


def test_cost_model_runs_the_fc_node_on_its_share_of_the_cores():
    # 8 hosts on 2 cores, a quarter core each (the rig's quotas): the FC node computes the head for
    # 7 conv nodes (7 x 50 ms) on its quarter core; pooling every node's CPU over the 2 cores
    # hid that (cnn, 8 hosts, 1 Gbit: auto chose stanza at 1,040 examples/s, hybrid ran 3,825)
    from parallax_tf import costmodel
    from rewriters.stanza import cost as stanza_cost
    loads, split = _fc_heavy_loads()
    shared = costmodel.Cluster(8, bandwidth_bytes_per_s=1e9 / 8, cores=2)
    got = stanza_cost.predict_stanza(loads, split, shared, 0.1, 1)
    alone = stanza_cost.predict_stanza(loads, split, dataclasses.replace(shared, cores=None), 0.1, 1)
    # the FC node's CPU work (its 7 x 50 ms and runtime) takes 4 times as long on a quarter core
    fc_work = 7 * 0.05 + shared.runtime_cpu
    assert got.collective_s - alone.collective_s == pytest.approx(fc_work * 3)
    assert got.step_s > fc_work * 4


def test_cost_model_spreads_a_compute_heavy_small_head_over_fc_nodes():
    from parallax_tf import costmodel
    from rewriters.stanza import cost as stanza_cost
    loads, split = _fc_heavy_loads(head_bytes=4096)
    split.head_compute_s = 0.5
    fc_nodes, _ = stanza_cost.choose_fc_nodes(loads, split, costmodel.Cluster(8, bandwidth_bytes_per_s=1e9 / 8), 0.6)
    assert fc_nodes > 1
    one = stanza_cost.predict_stanza(loads, split, costmodel.Cluster(8, bandwidth_bytes_per_s=1e9 / 8), 0.6, 1)
    piped = stanza_cost.predict_stanza(loads, split, costmodel.Cluster(8, bandwidth_bytes_per_s=1e9 / 8), 0.6, 1, 4)
    assert piped.step_s < one.step_s           # micro-batches overlap transfers with the FC compute


def _wide_head_cnn():
    """A small CNN whose FC head holds almost all the weights (4 MB)."""
    images = tf.compat.v1.placeholder(tf.float32, [None, 8, 8, 1], name="images")
    labels = tf.compat.v1.placeholder(tf.int64, [None], name="labels")
    kernel = tf.compat.v1.get_variable("conv/kernel", [3, 3, 1, 4])
    x = tf.reshape(tf.nn.relu(tf.nn.conv2d(images, kernel, 1, "SAME")), [-1, 256])
    for name, units in (("fc1", 2048), ("fc2", 10)):
        w = tf.compat.v1.get_variable(f"{name}/kernel", [int(x.shape[-1]), units])
        b = tf.compat.v1.get_variable(f"{name}/bias", [units], initializer=tf.compat.v1.zeros_initializer())
        x = tf.nn.bias_add(tf.matmul(x, w), b)
        x = tf.nn.relu(x) if name == "fc1" else x
    logits = x
    import parallax_tf as ptf
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    return ptf.Model(loss=loss, optimizer=tf.compat.v1.train.MomentumOptimizer(0.01, 0.9))


def _wide_images(ctx):
    rng = np.random.RandomState(ctx.step)
    return {"images": rng.randn(16, 8, 8, 1).astype(np.float32), "labels": rng.randint(0, 10, 16)}


def test_auto_chooses_stanza_when_the_cost_model_predicts_it():
    from parallax_tf import costmodel
    captured = capture(_wide_head_cnn, _wide_images, RunContext(), 0, **measurements("auto"))
    assert found_head(captured).compute_s > 0 and found_head(captured).batch_size == 16
    slow = costmodel.Cluster(8, bandwidth_bytes_per_s=10e6 / 8)
    plan = make_plan(PlanRequest(captured, "auto", 8, 8, cost_cluster=slow, options={"stanza": True}))
    assert plan.strategy == "stanza" and plan.section.fc_ranks == [7]
    assert all(v.reason.startswith("auto chose stanza (predicted ") and "ms per batch with 1 FC node(s)" in v.reason
               for v in plan.variables)
    assert "step of 7 batches" in plan.variables[0].reason and "step of 8 batches" in plan.variables[0].reason
    # by default auto keeps the batch: it stays data parallel and says what it left out
    plan = make_plan(PlanRequest(captured, "auto", 8, 8, cost_cluster=slow))
    assert plan.strategy == "auto" and plan.section is None
    assert all("would train on 7 batches instead of 8 (--auto_stanza allows it)" in v.reason
               for v in plan.trained)
    two = make_plan(PlanRequest(captured, "auto", 2, 2, cost_cluster=costmodel.Cluster(2, bandwidth_bytes_per_s=10e6 / 8),
                    options={"stanza": True}))
    assert two.strategy == "stanza" and two.section.conv_ranks == [0] and two.section.fc_ranks == [1]
    # a head too small to matter on fast links: data parallel stays
    fast = costmodel.Cluster(8, bandwidth_bytes_per_s=100e9 / 8)
    assert make_plan(PlanRequest(captured, "auto", 8, 8, cost_cluster=fast)).strategy == "auto"


def test_checkpoint_has_single_device_names_and_resume_continues():
    # 3 steps, then a restart to 5 from the checkpoint: the same as 5 uninterrupted steps
    ckpt, out = tempfile.mkdtemp(prefix="ptf-stanza-ckpt-"), tempfile.mkdtemp(prefix="ptf-stanza-ckpt-")
    flags = ["tests/jobs/train_case.py", "--np=3", "--case=cnn_bn", f"--out={out}", "--strategy=stanza",
             "--log_every=0", f"--ckpt_dir={ckpt}"]
    first = launch.run_ranks(1, flags + ["--steps=3"], launcher="python", timeout=240)
    assert first.returncode == 0, launch.tail(first)
    saved = tf.train.list_variables(tf.train.latest_checkpoint(ckpt))
    names = {name for name, _ in saved}
    assert {"sequential/dense/kernel", "sequential/conv2d/kernel", "sequential/bn/moving_mean"} <= names
    second = launch.run_ranks(1, flags + ["--steps=5"], launcher="python", timeout=240)
    assert second.returncode == 0, launch.tail(second)
    result = np.load(os.path.join(out, "cnn_bn.rank2.npz"))      # an FC node hands back every value too
    assert int(result["start_step"]) == 3 and int(result["global_step"]) == 5
    want = reference.train_per_rank_statistics("cnn_bn", "momentum", 2, steps=5)
    for name, value in want.items():
        assert reference.relative_error(result[f"var:{name}"], value) <= 1e-5, name
