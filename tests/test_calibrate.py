"""Calibration: tools.calibrate measures and writes the cost model's constants, the planner
reads them and its shard counts follow them."""
import json
import os
import tempfile

import pytest

from parallax_tf import calibration, costmodel
from parallax_tf.errors import ConfigError
from parallax_tf.inspect_graph import capture
from parallax_tf.model import RunContext
from parallax_tf.planner import make_plan
from tests.test_rig import _run

CONSTANTS = ("runtime_cpu_s", "task_cpu_s", "message_overhead_s", "rpc_overhead_s")


def test_calibrate_measures_and_writes_the_file_the_planner_reads():
    path = os.path.join(tempfile.mkdtemp(), "calibration.json")
    proc = _run(["tools.calibrate", "--model=mlp", "--cal_hosts=2", "--steps=8", "--warmup=2",
                 "--cal_round_trips=50", f"--calibration={path}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"wrote {path}" in proc.stdout
    data = json.load(open(path))
    assert all(data[k] >= 0 for k in CONSTANTS), data
    assert 1e-5 < data["rpc_overhead_s"] < 0.5 and data["message_overhead_s"] < 0.5
    runs = data["measured"]["cpu"]["runs"]
    assert [runs[r]["ps_tasks"] for r in ("hybrid_1", "hybrid_2")] == [1, 2]     # the mlp's one table
    assert all(run["cpu_s_per_step"] > 0 for run in runs.values())
    fit = data["measured"]["cpu"]["fit"]            # the file keeps the raw fit; the constants floor it at 0
    assert data["task_cpu_s"] == max(0.0, fit["task_cpu_s"])
    assert fit["task_cpu_s"] == pytest.approx(runs["hybrid_2"]["cpu_s_per_step"] - runs["hybrid_1"]["cpu_s_per_step"])

    got = calibration.load(path)
    assert got.constants() == {k: data[k] for k in CONSTANTS} and got.source == path
    from parallax_tf import api, flags
    cluster = api.cost_cluster(flags.resolve(calibration=path), hosts=2, ranks_per_host=1)
    assert {k: getattr(cluster, k) for k in CONSTANTS} == got.constants() and cluster.calibration == path


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
        plan = make_plan(captured, "hybrid", 8, 8, cost_cluster=cluster).by_name()
        return {name: plan[name] for name in ("embedding", "softmax_w")}

    for entry in shards(cheap).values():     # tasks are free: spread the hot spot over every host
        assert entry.partitions >= 8 and f"constants: {cheap}" in entry.reason, entry
        assert len({s.server for s in entry.shards}) == 8
    for entry in shards(costly).values():    # each task costs 0.5 s of CPU: keep the tables whole
        assert entry.partitions == 1 and f"constants: {costly}" in entry.reason, entry


def test_missing_unreadable_and_negative_calibration_files(monkeypatch):
    monkeypatch.setenv("PARALLAX_CALIBRATION", os.path.join(tempfile.mkdtemp(), "absent.json"))
    assert calibration.load().constants() == calibration.Calibration().constants()
    assert "no calibration file" in calibration.load().source
    bad = _write({"runtime_cpu_s": 0.01})
    with pytest.raises(ConfigError, match=f"calibration file {bad} is unreadable.*tools.calibrate"):
        calibration.load(bad)
    negative = _write({"runtime_cpu_s": -1.0, "task_cpu_s": 0.0, "message_overhead_s": 0.0, "rpc_overhead_s": 0.0})
    with pytest.raises(ConfigError, match="runtime_cpu_s must be >= 0"):
        calibration.load(negative)
