"""Calibration: tools.calibrate measures and writes the cost model's constants, the planner
reads them and its shard counts follow them."""
import dataclasses
import json
import os
import tempfile

import numpy as np
import pytest

from parallax_tf import calibration, costmodel
from parallax_tf.errors import ConfigError
from parallax_tf.inspect_graph import capture
from parallax_tf.model import RunContext
from parallax_tf.planner import PlanRequest, make_plan
from tests.test_rig import _run

CONSTANTS = calibration.REQUIRED + calibration.LATER


def test_calibrate_measures_and_writes_the_file_the_planner_reads():
    path = os.path.join(tempfile.mkdtemp(), "calibration.json")
    # (a batch of 32 from 16 rows: its allgather moves more than its PS traffic, so the runs
    # separate the terms; with 8 ids both move the same bytes. A small CNN is the dense model,
    # and a smaller one its second size; recsys' 19 tables beside the mlp's one separate the
    # alltoall route's CPU per step from its CPU per table.)
    proc = _run(["tools.calibrate", "--model=mlp", "--mlp_batch=32", "--cal_dense_model=cnn", "--cnn_conv_channels=4,8",
                 "--cnn_fc_units=64", "--cal_small_dense=--cnn_fc_units=8", "--cal_exchange_model=recsys",
                 "--recsys_user_buckets=1000", "--recsys_batch=16", "--cal_hosts=3", "--cal_few_hosts=2",
                 "--steps=8", "--warmup=2", "--cal_round_trips=50", "--cal_repeats=1", f"--calibration={path}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"wrote {path}" in proc.stdout
    data = json.load(open(path))
    assert all(data[k] >= 0 for k in CONSTANTS), data
    assert 1e-5 < data["rpc_overhead_s"] < 0.5 and data["message_overhead_s"] < 0.5
    runs = data["measured"]["cpu"]["runs"]
    # each run once here (--cal_repeats=1; the mean of repeats: test_repeated_runs_enter_as_their_mean)
    assert all(run["cpu_s_per_step_each"] == [run["cpu_s_per_step"]] for run in runs.values()), runs
    assert {name: (run["model"], run["hosts"], len(run["cpu_s_per_step_by_rank"])) for name, run in runs.items()} == {
        "hybrid_1": ("mlp", 3, 3), "hybrid_3": ("mlp", 3, 3), "hybrid_1_on_2": ("mlp", 2, 2),
        "allreduce": ("mlp", 3, 3), "allreduce_on_2": ("mlp", 2, 2), "allreduce_cnn": ("cnn", 3, 3),
        "allreduce_cnn_on_2": ("cnn", 2, 2), "allreduce_cnn_small": ("cnn", 3, 3),
        "allreduce_cnn_small_on_2": ("cnn", 2, 2), "collective": ("mlp", 3, 3), "collective_on_2": ("mlp", 2, 2),
        "collective_recsys": ("recsys", 3, 3)}
    assert {name: run["model_flags"] for name, run in runs.items() if run["model_flags"]} == {
        "allreduce_cnn_small": ["--cnn_fc_units=8"], "allreduce_cnn_small_on_2": ["--cnn_fc_units=8"]}
    terms = {name: run["terms_by_rank"] for name, run in runs.items()}
    # the mlp's one table in 1 shard: host 0's task (its rank's own process) serves every rank's
    # step, the others run theirs there; in 3 shards every host serves 3 and runs 2 elsewhere
    assert [(t["task"], t["served"], t["master"]) for t in terms["hybrid_1"]] == [(0, 3, 1), (1, 0, 1), (1, 0, 1)]
    assert [(t["task"], t["served"]) for t in terms["hybrid_3"]] == [(2, 3)] * 3
    assert [(t["task"], t["served"]) for t in terms["hybrid_1_on_2"]] == [(0, 2), (1, 0)]
    assert all((t["task"], t["served"], t["master"]) == (0, 0, 0) for name in terms if name.startswith("allreduce")
               for t in terms[name])
    # a rank receives 2(N-1)/N of the dense weights by ring AllReduce, each other rank's share of
    # the table by allgather, or (hybrid) its pulled rows and the pushes its host's task serves
    dense = {name: sum(v.bytes for v in capture(*make(), RunContext(), seed=0).variables if v.gradient == "dense")
             for name, make in (("mlp", _mlp), ("cnn", _cnn), ("cnn_small", lambda: _cnn(fc_units=[8])),
                                ("recsys", _recsys))}
    assert dense["cnn_small"] < dense["cnn"]
    for name, run in runs.items():
        ranks, model = run["hosts"], run["model"] + ("_small" if run["model_flags"] else "")
        assert all(t["peer"] == ranks - 1 and t["runtime"] == 1 for t in terms[name])
        assert all(t["ring"] == pytest.approx(2 * (ranks - 1) / ranks * dense[model]) for t in terms[name])
        assert all(t["replica"] == dense[model] for t in terms[name])      # dense weights: AllReduce in all
    assert terms["allreduce_on_2"][0]["received"] > 0
    assert all(t["received"] == pytest.approx(2 * terms["allreduce_on_2"][0]["received"]) for t in terms["allreduce"])
    assert all(t["received"] == 0 for name in terms if name.startswith("allreduce_cnn") for t in terms[name])
    assert terms["hybrid_1"][0]["received"] > terms["hybrid_1"][1]["received"] > 0    # host 0 takes the pushes
    # the alltoall route: per other rank it exchanges with, and per table on it (the mlp's one,
    # recsys' 19)
    tables = {"collective": 1, "collective_on_2": 1, "collective_recsys": 19}
    assert all((t["exchange"], t["exchange_table"]) == ((runs[name]["hosts"] - 1, tables[name]) if name in tables
                                                        else (0, 0)) for name in terms for t in terms[name]), terms
    # every rank: its CPU per step = its model's compute + each term's constant x its figure,
    # the constants fitted by least squares over all ranks of all runs
    for name, run in runs.items():
        assert all(cpu > 0 for cpu in run["cpu_s_per_step_by_rank"]) and run["compute_s"] > 0
        assert run["cpu_s_per_step"] == pytest.approx(np.mean(run["cpu_s_per_step_by_rank"]))
        for t, fitted in zip(terms[name], run["fitted_cpu_s_by_rank"]):
            assert fitted == pytest.approx(run["compute_s"] + sum(data[costmodel.CPU_TERMS[k]] * v for k, v in t.items()),
                                           abs=1e-9), name

    # fitted again from the file's own runs (after a change to the model's terms): the same fit
    refit = _run(["tools.calibrate", "--cal_refit", "--mlp_batch=32", "--cnn_conv_channels=4,8", "--cnn_fc_units=64",
                  "--recsys_user_buckets=1000", "--recsys_batch=16", f"--calibration={path}"])
    assert refit.returncode == 0, refit.stderr[-3000:]
    again = json.load(open(path))
    assert {k: again[k] for k in CONSTANTS} == pytest.approx({k: data[k] for k in CONSTANTS}, rel=1e-6, abs=1e-15)
    other_sizes = _run(["tools.calibrate", "--cal_refit", f"--calibration={path}"])
    assert other_sizes.returncode != 0 and "give the same model flags" in other_sizes.stderr
    older = _write({"runtime_cpu_s": 0.01, "task_cpu_s": 0.0, "message_overhead_s": 0.0, "rpc_overhead_s": 0.0})
    refused = _run(["tools.calibrate", "--cal_refit", f"--calibration={older}"])
    assert refused.returncode != 0 and f"{older} holds no runs measured rank by rank" in refused.stderr

    got = calibration.load(path)
    assert got.constants() == {k: data[k] for k in CONSTANTS} and got.source == path
    from parallax_tf import api, flags
    cluster = api.cost_cluster(flags.resolve(calibration=path), hosts=2, ranks_per_host=1)
    assert {k: getattr(cluster, k) for k in CONSTANTS} == got.constants() and cluster.calibration == path


def _mlp():
    from models import mlp
    return mlp.make_model_fn(), mlp.make_input_fn()


def _recsys():
    from models import recsys
    return recsys.make_model_fn(user_buckets=1000), recsys.make_input_fn(user_buckets=1000, batch=16)


def _cnn(fc_units=(64,)):
    from models import cnn
    return cnn.make_model_fn(conv_channels=[4, 8], fc_units=list(fc_units)), cnn.make_input_fn()


def test_the_fit_is_the_least_squares_one_with_no_negative_term():
    from tools import calibrate
    rng = np.random.default_rng(0)
    terms = rng.random((7, 6)) * [1, 7, 1, 3, 1e6, 1e6]           # counts and bytes, as the runs have
    truth = np.array([2e-3, 5e-4, 1e-3, 2e-3, 7e-9, 3e-9])
    assert calibrate.nonnegative_fit(terms.tolist(), (terms @ truth).tolist()) == pytest.approx(truth, rel=1e-6)
    # runs that put one term below 0 (noise): it is 0, the others the best fit without it
    noisy = terms @ np.array([2e-3, 5e-4, -1e-3, 2e-3, 7e-9, 3e-9])
    got = calibrate.nonnegative_fit(terms.tolist(), noisy.tolist())
    without = np.delete(terms, 2, axis=1)
    assert got[2] == 0 and np.delete(got, 2) == pytest.approx(np.linalg.lstsq(without, noisy, rcond=None)[0], rel=1e-6)
    assert (got >= 0).all()


def _write(constants: dict) -> str:
    path = os.path.join(tempfile.mkdtemp(), "calibration.json")
    with open(path, "w") as f:
        json.dump(constants, f)
    return path


def test_shard_counts_follow_the_calibration_file():
    from models import lm
    captured = capture(lm.make_model_fn(), lm.make_input_fn(), RunContext(), seed=0, time_compute=True)
    cheap = _write({"runtime_cpu_s": 0.01, "task_cpu_s": 0.0, "message_overhead_s": 1e-5, "rpc_overhead_s": 1e-3})
    costly = _write({"runtime_cpu_s": 0.01, "task_cpu_s": 0.5, "message_overhead_s": 1e-5, "rpc_overhead_s": 1e-3})
    link = costmodel.parse_rate("10mbit")

    def shards(path):
        # 8 hosts sharing 2 cores (as tools.cluster emulates them): a PS task costs every rank CPU
        cluster = costmodel.Cluster.calibrated(8, 1, link, cores=2, calibration=calibration.load(path))
        plan = make_plan(PlanRequest(captured, "hybrid", 8, 8, cost_cluster=cluster)).by_name()
        return {name: plan[name] for name in ("embedding", "softmax_w")}

    for entry in shards(cheap).values():     # tasks are free: spread the hot spot over every host
        assert entry.partitions >= 8 and f"constants: {cheap}" in entry.reason, entry
        assert len({s.server for s in entry.shards}) == 8
    for entry in shards(costly).values():    # each task costs 0.5 s of CPU: keep the tables whole
        assert entry.partitions == 1 and f"constants: {costly}" in entry.reason, entry


def test_repeated_runs_enter_as_their_mean():
    from tools import calibrate
    got = calibrate.mean_of_repeats([
        {"cpu_s_per_step_per_rank": 0.010, "step_s": 0.030, "cpu_s_per_step_by_rank": [0.012, 0.008]},
        {"cpu_s_per_step_per_rank": 0.014, "step_s": 0.040, "cpu_s_per_step_by_rank": [0.016, 0.012]}])
    assert got == {"cpu_s_per_step": pytest.approx(0.012), "cpu_s_per_step_each": [0.010, 0.014],
                   "cpu_s_per_step_by_rank": pytest.approx([0.014, 0.010]), "step_s": pytest.approx(0.035)}


def test_missing_unreadable_and_negative_calibration_files(monkeypatch):
    monkeypatch.setenv("PARALLAX_CALIBRATION", os.path.join(tempfile.mkdtemp(), "absent.json"))
    assert calibration.load().constants() == calibration.Calibration().constants()
    assert "no calibration file" in calibration.load().source
    # a file from before the later terms: those take their defaults (0 but the alltoall route's
    # measured CPU per table), the rest is read (the allgather-only byte term of one earlier
    # format is not the received one)
    older = {"runtime_cpu_s": 0.01, "task_cpu_s": 0.002, "message_overhead_s": 1e-4, "rpc_overhead_s": 1e-3}
    older_with_gather = {**older, "gather_cpu_s_per_byte": 1e-9}
    defaults = {**dict.fromkeys(calibration.LATER, 0.0), "exchange_table_cpu_s": 0.6e-3}
    assert calibration.load(_write(older_with_gather)).constants() == {**older, **defaults}
    assert calibration.load(_write(older)).constants() == {**older, **defaults}
    bad = _write({"runtime_cpu_s": 0.01})
    with pytest.raises(ConfigError, match=f"calibration file {bad} is unreadable.*tools.calibrate"):
        calibration.load(bad)
    negative = _write({"runtime_cpu_s": -1.0, "task_cpu_s": 0.0, "message_overhead_s": 0.0, "rpc_overhead_s": 0.0})
    with pytest.raises(ConfigError, match="runtime_cpu_s must be >= 0"):
        calibration.load(negative)


def test_cpu_terms_per_other_rank_master_and_received_byte_and_auto_follows():
    """The calibrated terms enter a rank's CPU per step exactly (the gRPC master's only with PS
    variables); an allgather whose bytes cost more CPU than the PS tasks that would replace it
    sends auto's sparse tables to the PS."""
    from models import lm
    captured = capture(lm.make_model_fn(), lm.make_input_fn(), RunContext(), seed=0)
    loads = costmodel.loads_from(captured)
    link = costmodel.parse_rate("1gbit")
    cluster = costmodel.Cluster(4, 1, link, cores=2, runtime_cpu_s=0.004, task_cpu_s=0.002)
    gathered_all = {l.name: costmodel.Choice("allreduce") for l in loads}
    sparse = [l for l in loads if l.gradient == "sparse"]
    # from 3 other ranks by allgather; 2(N-1)/N of each dense gradient by ring AllReduce
    received = sum(3 * costmodel.allgathered_bytes(l) for l in sparse)
    ring = sum(2 * 3 / 4 * l.bytes for l in loads if l.gradient == "dense")

    def cpu_bound(**terms):
        return costmodel.predict(loads, gathered_all, dataclasses.replace(cluster, **terms), 0.001).cpu_bound_s
    turns = 4 / 2
    assert cpu_bound(peer_cpu_s=0.001) - cpu_bound() == pytest.approx(0.001 * 3 * turns)
    assert cpu_bound(master_cpu_s=0.001) == cpu_bound()           # no PS variable: no gRPC master
    on_ps = {**gathered_all, "embedding": costmodel.Choice("ps", 1)}
    with_master = costmodel.predict(loads, on_ps, dataclasses.replace(cluster, master_cpu_s=0.001), 0.001)
    assert with_master.cpu_bound_s - costmodel.predict(loads, on_ps, cluster, 0.001).cpu_bound_s == \
        pytest.approx(0.001 * turns)
    assert cpu_bound(received_cpu_s_per_byte=1e-8) - cpu_bound() == pytest.approx(1e-8 * received * turns)
    assert cpu_bound(ring_cpu_s_per_byte=1e-8) - cpu_bound() == pytest.approx(1e-8 * ring * turns)
    dense = sum(l.bytes for l in loads if l.gradient == "dense")          # every rank updates its replica
    assert cpu_bound(replica_cpu_s_per_byte=1e-8) - cpu_bound() == pytest.approx(1e-8 * dense * turns)

    def routes(gather_cost, exchange_cost=1.0):     # exchange_cost: the alltoall route's CPU per peer and table
        chosen = costmodel.choose(loads, dataclasses.replace(cluster, received_cpu_s_per_byte=gather_cost,
                                                             exchange_cpu_s=exchange_cost,
                                                             exchange_table_cpu_s=exchange_cost), 0.001)
        return {l.name: chosen[l.name].route for l in sparse}
    assert set(routes(0.0).values()) == {"allreduce"}      # a free allgather beats 2 ms per PS task
    costly = routes(5e-8)          # ~8 ms of CPU for each large table's allgather does not
    assert (costly["embedding"], costly["softmax_w"]) == ("ps", "ps"), costly
    # an exchange that costs no CPU of its own: alltoall receives only the rows a rank owns and
    # serves, and runs no PS task
    assert set(routes(5e-8, exchange_cost=0.0).values()) == {"alltoall"}


def test_a_model_captured_at_other_sizes_leaves_the_flags_as_they_were():
    from absl import flags
    from tools import shared
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()          # the defaults, as a tool started with no flags has them
    given = list(flags.FLAGS.cnn_fc_units), flags.FLAGS["cnn_fc_units"].present
    small = shared.capture_model("cnn", ["--cnn_conv_channels=4,8", "--cnn_fc_units=8"])
    fc = [v for v in small.variables if list(v.shape) == [8, 10]]
    assert len(fc) == 1, [v.shape for v in small.variables]      # the head: 8 units -> 10 classes
    assert (list(flags.FLAGS.cnn_fc_units), flags.FLAGS["cnn_fc_units"].present) == given
    assert flags.FLAGS.cnn_conv_channels == ["16", "32"]
    with pytest.raises(SystemExit, match="give a flag as --name=value"):
        shared.capture_model("cnn", ["--cnn_fc_width=8"])
    with pytest.raises(SystemExit, match="--cnn_batch=x: "):
        shared.capture_model("cnn", ["--cnn_batch=x"])
    assert flags.FLAGS.cnn_batch == 32
