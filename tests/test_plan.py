"""inspect and plan without any ranks: classification, routes, shards, JSON, the table."""

import numpy as np
import pytest
import tensorflow as tf

import parallax_tf as ptf
from parallax_tf.inspect_graph import capture
from parallax_tf.model import RunContext
from parallax_tf.planner import PlanRequest, make_plan
from tests import cases, launch


def _capture(model, optimizer="sgd"):
    return capture(cases.build(model, optimizer), cases.input_fn_for(model), RunContext(), seed=0)


def test_inspect_classifies_gradients_and_layers():
    info = {v.name: v for v in _capture("mixed").variables}
    assert (info["emb"].gradient, info["emb"].layer) == ("sparse", "embedding")
    assert (info["w"].gradient, info["w"].layer) == ("dense", "fully_connected")
    assert (info["b"].gradient, info["b"].layer) == ("dense", "bias")
    assert info["emb"].bytes == cases.VOCAB * cases.DIM * 4
    # one batch of 4 examples x 3 ids touches at most 12 distinct rows, and at least one
    assert 1 <= info["emb"].rows_touched <= 12


def test_inspect_rows_touched_counts_distinct_ids():
    info = {v.name: v for v in _capture("duplicates").variables}
    ids = cases.batch("duplicates", 0, 0)["ids"]
    assert info["emb"].rows_touched == len(np.unique(ids))


def test_inspect_recurrent_and_user_partitioned():
    info = {v.name: v for v in _capture("rnn").variables}
    assert info["cell_w"].layer == "recurrent"
    part = {v.name: v for v in _capture("partitioned").variables}["emb"]
    assert part.user_partitioned and part.part_rows == [7, 7, 7] and part.shape == [21, 4]


def test_variable_used_sparse_and_dense_is_dense():
    def model_fn():
        ids = tf.compat.v1.placeholder(tf.int64, [None], name="ids")
        emb = tf.compat.v1.get_variable("emb", [10, 2])
        loss = tf.reduce_mean(tf.gather(emb, ids)) + tf.reduce_sum(emb)
        return ptf.Model(loss=loss, optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))
    got = capture(model_fn, lambda ctx: {"ids": np.arange(3)}, RunContext(), seed=0)
    assert got.variables[0].gradient == "dense"
    plan = make_plan(PlanRequest(got, "hybrid", num_ranks=2, num_hosts=1))
    assert plan.variables[0].route == "allreduce"


@pytest.mark.parametrize("strategy,emb_route,w_route", [
    ("hybrid", "ps", "allreduce"), ("ps", "ps", "ps"), ("allreduce", "allreduce", "allreduce")])
def test_routes_per_strategy(strategy, emb_route, w_route):
    plan = make_plan(PlanRequest(_capture("mixed"), strategy, num_ranks=4, num_hosts=2)).by_name()
    assert plan["emb"].route == emb_route and plan["w"].route == w_route


def test_shard_count_from_the_cost_model_override_and_server_spread():
    from parallax_tf.costmodel import Cluster
    captured = _capture("mixed")
    one_host = make_plan(PlanRequest(captured, "hybrid", 4, 1)).by_name()["emb"]
    assert one_host.partitions == 1 and "cost model: predicted step" in one_host.reason   # nothing to spread
    slow_links = Cluster(2, 2, bandwidth_bytes_per_s=1e3)          # every byte counts: spread over both hosts
    spread = make_plan(PlanRequest(captured, "hybrid", 4, 2, cost_cluster=slow_links)).by_name()["emb"]
    assert spread.partitions == 2 and sorted(s.server for s in spread.shards) == [0, 1], spread
    assert "2 partition(s) (cost model: predicted step" in spread.reason
    busy_cpus = Cluster(2, 2, bandwidth_bytes_per_s=1e3, cores=1, task_cpu_s=10.0)   # each PS task costs 10s
    assert make_plan(PlanRequest(captured, "hybrid", 4, 2, cost_cluster=busy_cpus)).by_name()["emb"].partitions == 1
    forced = make_plan(PlanRequest(captured, "hybrid", 4, 2, partitions=3, cost_cluster=slow_links)).by_name()["emb"]
    assert [(s.row_start, s.row_end) for s in forced.shards] == [(0, 7), (7, 14), (14, 20)]
    assert [s.name for s in forced.shards] == ["emb/part_0", "emb/part_1", "emb/part_2"]
    assert "3 partition(s) (--partitions)" in forced.reason
    even = make_plan(PlanRequest(captured, "hybrid", 4, 2, partitions=4)).by_name()["emb"]
    assert [s.row_end - s.row_start for s in even.shards] == [5, 5, 5, 5]
    assert sorted({s.server for s in even.shards}) == [0, 1]


def test_tf_variable_is_never_partitioned_and_says_why():
    def model_fn():
        ids = tf.compat.v1.placeholder(tf.int64, [None], name="ids")
        emb = tf.Variable(tf.ones([10, 2]), name="emb")
        return ptf.Model(loss=tf.reduce_mean(tf.gather(emb, ids)),
                         optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))
    got = capture(model_fn, lambda ctx: {"ids": np.arange(3)}, RunContext(), seed=0)
    entry = make_plan(PlanRequest(got, "hybrid", 2, 1, partitions=2)).variables[0]
    assert entry.partitions == 1 and "created by tf.Variable" in entry.reason


def test_bytes_estimates():
    plan = make_plan(PlanRequest(_capture("mixed"), "hybrid", num_ranks=4, num_hosts=1)).by_name()
    assert plan["w"].bytes_per_step == int(2 * 3 / 4 * cases.DIM * cases.CLASSES * 4)   # ring AllReduce
    rows = _capture("mixed").variables[0].rows_touched
    assert plan["emb"].bytes_per_step == rows * (cases.DIM * 4 + 8) + rows * cases.DIM * 4   # push + pull


def test_plan_round_trips_json_and_prints_a_table():
    plan = make_plan(PlanRequest(_capture("partitioned"), "hybrid", 2, 1))
    again = ptf.Plan.from_json(plan.to_json())
    assert again == plan
    table = plan.table()
    assert table.splitlines()[0].split() == ["variable", "shape", "MB", "grad", "layer", "route", "shards",
                                             "est.", "bytes/step/rank"]
    assert "emb       21x4" in table and "3 (user)" in table


def test_lm_plan_only_puts_embedding_and_softmax_on_ps():
    proc = launch.run_ranks(1, ["-m", "models.lm", "--plan_only", "--np=2"], launcher="python", timeout=180)
    assert proc.returncode == 0, launch.tail(proc)
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line[:1].isalpha()}
    # one host: shards could only add tasks, so the cost model keeps each table whole
    assert rows["embedding"][3:7] == ["sparse", "embedding", "ps", "1"], rows["embedding"]
    assert rows["softmax_w"][3:7] == ["sparse", "softmax", "ps", "1"], rows["softmax_w"]
    assert rows["lstm/kernel"][3:6] == ["dense", "recurrent", "allreduce"]


def test_layer_kinds_of_an_unrolled_lm():
    """A weight reused step after step is recurrent; gathered output-layer weights are softmax."""
    import models.lm as lm
    got = capture(lm.make_model_fn(vocab=500), lm.make_input_fn(vocab=500), RunContext(), seed=0)
    assert {v.name: v.layer for v in got.variables} == {
        "embedding": "embedding", "lstm/kernel": "recurrent", "lstm/bias": "recurrent",
        "softmax_w": "softmax", "softmax_b": "softmax"}


def test_layer_kinds_from_tf_keras_layer_types():
    import tf_keras

    def model_fn():
        images = tf.compat.v1.placeholder(tf.float32, [None, 8, 8, 3], name="images")
        ids = tf.compat.v1.placeholder(tf.int64, [None, 5], name="ids")
        conv = tf_keras.Sequential([tf_keras.layers.Conv2D(4, 3), tf_keras.layers.BatchNormalization(),
                                    tf_keras.layers.Flatten(), tf_keras.layers.Dense(3)])
        text = tf_keras.Sequential([tf_keras.layers.Embedding(20, 4), tf_keras.layers.LSTM(3)])
        loss = tf.reduce_mean(conv(images, training=True)) + tf.reduce_mean(text(ids))
        return ptf.Model(loss=loss, optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))
    feeds = lambda ctx: {"images": np.ones([2, 8, 8, 3], np.float32), "ids": np.ones([2, 5], np.int64)}  # noqa: E731
    got = capture(model_fn, feeds, RunContext(), seed=0)
    layers = {v.name.split("sequential/", 1)[-1]: v.layer for v in got.variables}
    assert layers == {"conv2d/kernel": "conv", "conv2d/bias": "conv", "batch_normalization/gamma": "norm",
                      "batch_normalization/beta": "norm", "dense/kernel": "fully_connected",
                      "dense/bias": "fully_connected", "embedding/embeddings": "embedding",
                      "lstm/lstm_cell/kernel": "recurrent", "lstm/lstm_cell/recurrent_kernel": "recurrent",
                      "lstm/lstm_cell/bias": "recurrent"}
    state = {s.name.split("sequential/", 1)[-1]: (s.layer, s.per_rank) for s in got.state}
    assert state == {"batch_normalization/moving_mean": ("norm", True),
                     "batch_normalization/moving_variance": ("norm", True)}


def test_model_state_and_global_step_in_the_plan():
    got = _capture("ema", "adagrad")
    assert got.global_step == "global_step"
    assert {s.name: s.per_rank for s in got.state} == {f"{v}/ExponentialMovingAverage": False for v in ("emb", "w", "b")}
    plan = make_plan(PlanRequest(_capture("bn", "momentum"), "hybrid", 2, 1))
    local = {v.name: (v.route, v.params["combine"]) for v in plan.variables if v.route == "local"}
    assert local == {"bn/moving_mean": ("local", "mean"), "bn/moving_variance": ("local", "mean")}
    assert plan.global_step == "global_step" and "global_step=global_step" in plan.table()
    assert ptf.Plan.from_json(plan.to_json()) == plan


def test_keras_cnn_reference_model_plans_batch_norm_state():
    proc = launch.run_ranks(1, ["-m", "models.cnn", "--cnn_keras", "--plan_only", "--np=2", "--cnn_fc_units=64,64"],
                            launcher="python", timeout=180)
    assert proc.returncode == 0, launch.tail(proc)
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.startswith("cnn/")}
    assert rows["cnn/conv1_1/kernel"][3:6] == ["dense", "conv", "allreduce"]
    assert rows["cnn/bn1_1/gamma"][3:6] == ["dense", "norm", "allreduce"]
    assert rows["cnn/fc1/kernel"][3:6] == ["dense", "fully_connected", "allreduce"]
    assert rows["cnn/bn2_2/moving_mean"][3:7] == ["none", "norm", "local", "mean"]
    assert "global_step=global_step" in proc.stdout


def test_slim_dp_plan_routes_and_splits():
    """Dense variables on route significant with the Slim-DP options; sparse ones on the PS; a
    global copy of 64k elements or more split over every server as flat element ranges."""
    def model_fn(ctx=None):
        x = tf.compat.v1.placeholder(tf.float32, [None, 300], name="x")
        big = tf.compat.v1.get_variable("big", [300, 300])
        small = tf.compat.v1.get_variable("small", [300, 2])
        emb = tf.compat.v1.get_variable("emb", [50, 300])
        ids = tf.compat.v1.placeholder(tf.int64, [None], name="ids")
        h = tf.matmul(x, big) + tf.compat.v1.nn.embedding_lookup(emb, ids)
        loss = tf.reduce_mean(tf.square(tf.matmul(h, small)))
        return ptf.Model(loss=loss, optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))
    got = capture(model_fn, lambda ctx: {"x": np.ones([2, 300], np.float32), "ids": np.arange(2)}, RunContext(), seed=0)
    slim = {"core": 0.1, "explore": 0.02, "refresh": 10, "period": 2, "update_weight": 1.0, "error_feedback": False}
    whole = make_plan(PlanRequest(got, "slim_dp", num_ranks=8, num_hosts=4, options=slim))
    plan = whole.by_name()
    assert plan["emb"].route == "ps" and plan["big"].route == plan["small"].route == "significant"
    assert whole.options == slim and plan["big"].layout == "flat"     # the options once, on the plan
    assert [(s.row_start, s.row_end) for s in plan["big"].shards] == [(0, 22500), (22500, 45000), (45000, 67500),
                                                                     (67500, 90000)]
    assert sorted(s.server for s in plan["big"].shards) == [0, 1, 2, 3]
    assert [(s.row_start, s.row_end) for s in plan["small"].shards] == [(0, 600)]
    assert plan["big"].bytes_per_step == int(2 * 0.12 * 90000 * 4 / 2)


def test_slim_dp_fractions_are_checked():
    from parallax_tf import flags as ptf_flags
    from parallax_tf.errors import ConfigError
    with pytest.raises(ConfigError, match=r"--slim_core \(0.9\) and --slim_explore \(0.2\)"):
        ptf_flags.resolve(slim_core=0.9, slim_explore=0.2)
    with pytest.raises(ConfigError, match="--slim_period and --slim_refresh must be >= 1"):
        ptf_flags.resolve(slim_period=0)


def test_timing_a_step_stops_where_a_models_own_dataset_ends():
    """The planner times a few steps of the model in its own graph; a tf.data pipeline of the
    model's with fewer batches than that is timed on the batches it has, not an error."""
    def model_fn():
        batches = tf.data.Dataset.from_tensor_slices(np.ones([3, 4, 2], np.float32))   # 3 batches
        x = tf.compat.v1.data.make_one_shot_iterator(batches).get_next()
        w = tf.compat.v1.get_variable("w", [2, 1])
        loss = tf.reduce_mean(tf.matmul(x, w) ** 2)
        return ptf.Model(loss=loss, optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))
    got = capture(model_fn, None, RunContext(), seed=0, time_compute=True)
    assert got.compute_s is not None and got.compute_s >= 0
