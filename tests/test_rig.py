"""The measurement rig: emulated hosts, bytes against link counters, the bench, the cost model."""
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

from parallax_tf import costmodel
from parallax_tf.costmodel import Choice, Cluster, Load
from parallax_tf.errors import ConfigError
from parallax_tf.inspect_graph import capture
from parallax_tf.model import RunContext
from parallax_tf.planner import PlanRequest, make_plan, measurements
from tests import launch
from tools import cpu_quota, netns


def _run(args, timeout=600, env=None):
    return subprocess.run([sys.executable, "-m", *args], cwd=launch.ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=launch.ROOT, TF_CPP_MIN_LOG_LEVEL="2",
                                                    **(env or {})))


def test_two_emulated_hosts_train_and_are_torn_down():
    proc = _run(["tools.cluster", "--hosts=2", "--", sys.executable, "-m", "models.mlp", "--steps=3", "--verbose"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    if not netns.have_root():        # the documented fallback: loopback, said plainly
        assert "emulated hosts need root" in proc.stderr
        return
    workers = dict(re.findall(r"parallax_tf rank (\d): worker (198\.18\.0\.\d+):\d+", proc.stderr))
    assert workers == {"0": "198.18.0.1", "1": "198.18.0.2"}      # each rank on its host's address
    assert "mlp: first loss" in proc.stdout
    assert netns.existing_namespaces() == []
    assert not [d for d in os.listdir("/etc/netns") if d.startswith("ptf-")] if os.path.isdir("/etc/netns") else True


def test_the_rig_queues_what_the_cost_model_assumes_a_port_holds():
    # the launcher does not import TensorFlow, so the two say it apart
    from parallax_tf import costmodel
    assert netns.QUEUE_S == costmodel.PORT_QUEUE_S


def test_teardown_also_after_a_failing_command():
    proc = _run(["tools.cluster", "--hosts=2", "--", "false"])
    assert proc.returncode != 0
    assert netns.existing_namespaces() == []


def test_bench_table_json_plot_and_bytes_against_link_counters():
    out = os.path.join(tempfile.mkdtemp(), "bench.json")
    proc = _run(["tools.bench", "--hosts=2", "--model=lm", "--strategies=hybrid,horovod", "--steps=15",
                 "--warmup=3", f"--json={out}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"strategy\s+examples/s\s+step ms\s+CPU ms/step/rank\s+runtime CPU ms\s+wire B/step/rank", proc.stdout)
    data = json.load(open(out))
    # one core per emulated host (2 cores, 2 hosts): one thread per TF pool, baseline included
    pools = "1" if netns.have_root() and cpu_quota.available() else "2"
    for strategy in ("hybrid", "horovod"):     # where each run's CPU went, by thread
        assert re.search(rf"^{strategy} CPU ms/step/rank by thread \({pools} per TF pool\): .*main \d",
                         proc.stdout, re.M), proc.stdout
        assert data["results"][strategy]["pool_threads"] == [int(pools)]
    assert data["cluster"]["hosts"] == 2 and set(data["results"]) == {"hybrid", "horovod"}
    for result in data["results"].values():
        assert {"examples_per_s", "step_s", "bytes_per_step", "lower_bound_bytes_per_step"} <= set(result)
        assert result["examples_per_s"] > 0 and result["step_s"] > 0
    assert os.path.getsize(out.replace(".json", ".png")) > 1000
    assert 0 < data["results"]["hybrid"]["held_out_loss"] < 20      # rank 0 evaluated the result
    if netns.have_root():
        hybrid = data["results"]["hybrid"]
        # what the graph says it sends vs what the links carried (protocol overhead on top)
        ratio = hybrid["bytes_per_step"] / hybrid["reported_bytes_per_step"]
        assert 1.0 <= ratio <= 1.25, ratio
        # and how many frames carried them: the headers' share is printed
        assert hybrid["packets_per_step"] > 0 and hybrid["retransmitted_segments_per_step"] >= 0
        assert 66 < hybrid["bytes_per_step"] / hybrid["packets_per_step"] < 65_600
        assert re.search(r"^hybrid wire per step per rank: .* in [\d,]+ frames .*headers", proc.stdout, re.M)


def test_cost_model_link_traffic():
    cluster = Cluster(hosts=4, ranks_per_host=1, bandwidth_bytes_per_s=1e6)
    dense = Load("w", 4_000_000, "dense", 4000, 1000)
    tx, rx, _ = costmodel.host_traffic(dense, Choice("allreduce"), cluster)
    assert tx == rx == [2 * 3 / 4 * 4_000_000] * 4                      # ring: 2(N-1)/N of it
    emb = Load("emb", 1000 * 400, "sparse", 400, 1000, rows_touched=10, gathered_bytes=20 * 400)
    tx, rx, messages = costmodel.host_traffic(emb, Choice("ps", 1), cluster)
    push, pull = 10 * (400 + 8) + 10 * 8, 10 * 400     # rows + ids and the ids to pull; distinct rows back
    assert rx[0] == 3 * push and tx[0] == 3 * pull                       # one server: fan-in of 3 hosts
    assert rx[1] == pull and tx[1] == push
    assert messages == [4, 0, 0, 0]                                       # one graph run per rank
    spread, _, _ = costmodel.host_traffic(emb, Choice("ps", 4), cluster)
    assert max(spread) < max(tx)                                          # shards spread the hot spot
    assert costmodel.parse_rate("100mbit") == 12.5e6 and costmodel.parse_delay("2ms") == 0.002


def test_collectives_add_to_the_step_and_ps_traffic_hides_under_the_cpu():
    """A collective is a barrier: its link time adds to a CPU-bound step. A PS transfer is one
    rank's own: it overlaps the CPU work until it is the longer of the two."""
    cluster = Cluster(hosts=2, bandwidth_bytes_per_s=1e6, runtime_cpu_s=0.05, task_cpu_s=0.0, rpc_overhead_s=0.0,
                      message_overhead_s=0.0, peer_cpu_s=0.0, master_cpu_s=0.0, received_cpu_s_per_byte=0.0,
                      ring_cpu_s_per_byte=0.0)
    dense = Load("w", 10_000, "dense", 100, 100)
    table = Load("emb", 100_000, "sparse", 100, 1000, rows_touched=100, gathered_bytes=10_000)
    reduced = costmodel.predict([dense, table], {"w": Choice("allreduce"), "emb": Choice("ps", 1)}, cluster, 0.01)
    assert reduced.collective_s == pytest.approx(10_000 / 1e6)         # ring on 2 ranks: the whole gradient
    assert reduced.network_s < reduced.cpu_bound_s == pytest.approx(0.06)
    assert reduced.step_s == pytest.approx(0.06 + reduced.collective_s)  # PS traffic hidden, the ring not
    slow = dataclasses.replace(cluster, bandwidth_bytes_per_s=1e5)
    got = costmodel.predict([dense, table], {"w": Choice("allreduce"), "emb": Choice("ps", 1)}, slow, 0.01)
    assert got.network_s > got.cpu_bound_s                               # now the PS transfer is longer
    assert got.step_s == pytest.approx(0.01 + got.network_s + got.collective_s)
    # and each byte received costs CPU: the PS's at one rate, the ring's at its own; the step
    # waits for the busiest host's rank: host 0, whose task takes the other host's pushes
    costly = dataclasses.replace(cluster, received_cpu_s_per_byte=1e-6, ring_cpu_s_per_byte=1e-7)
    routes = {"w": Choice("allreduce"), "emb": Choice("ps", 1)}
    terms = costmodel.host_cpu_terms([dense, table], routes, cluster)
    assert [t["ring"] for t in terms] == [10_000, 10_000]
    assert terms[0]["received"] > terms[1]["received"] > 0
    assert costmodel.received_bytes([dense, table], routes, cluster) == pytest.approx(
        (terms[0]["received"] + terms[1]["received"]) / 2)
    assert costmodel.predict([dense, table], routes, costly, 0.01).cpu_bound_s == \
        pytest.approx(0.06 + 1e-6 * terms[0]["received"] + 1e-7 * 10_000)
    # its task serves both ranks' steps; the other rank runs its step there
    served = dataclasses.replace(cluster, serve_cpu_s=0.004, task_cpu_s=0.001)
    assert [(t["served"], t["task"]) for t in terms] == [(2, 0), (0, 1)]
    assert costmodel.host_cpu_s([dense, table], routes, served, 0.01) == pytest.approx([0.06 + 0.008, 0.06 + 0.001])


def test_auto_moves_only_the_rows_of_embeddings_and_allreduces_dense_layers():
    """Where the links set the pace, a table's rows travel (PS or alltoall, both near the lower
    bound: measured on lm at 10 Mbit, 419 and 417 ms per step) and never its whole allgathered
    gradient; dense layers take the ring AllReduce."""
    from models import lm
    captured = capture(lm.make_model_fn(), lm.make_input_fn(), RunContext(), seed=0, **measurements("auto"))
    def plan_at(rate):
        cluster = Cluster(hosts=8, ranks_per_host=1, bandwidth_bytes_per_s=costmodel.parse_rate(rate))
        return make_plan(PlanRequest(captured, "auto", num_ranks=8, num_hosts=8, cost_cluster=cluster)).by_name()
    for rate in ("100mbit", "10mbit"):
        plan = plan_at(rate)
        for sparse in ("embedding", "softmax_w"):
            assert plan[sparse].route in ("ps", "alltoall"), plan[sparse]
            assert "cost model: predicted step" in plan[sparse].reason
            # no server takes a big table's fan-in alone: its rows are spread over every host
            if plan[sparse].route == "ps":
                assert {s.server for s in plan[sparse].shards} == set(range(8)), plan[sparse]
            else:
                assert plan[sparse].params == {"rank_shards": 8}, plan[sparse]
        assert plan["lstm/kernel"].route == plan["lstm/bias"].route == "allreduce"


def test_auto_counts_an_allgather_as_collectives_of_its_own():
    """lm, 8 hosts, 100 Mbit, 2 cores: moving the tiny softmax bias off the PS saves a PS task,
    but its allgather runs two rings of 7 messages beside the AllReduce. The sweep measured that
    plan at 131 ms per step against hybrid's 116 ms, so auto keeps the bias on the PS."""
    from models import lm
    captured = capture(lm.make_model_fn(), lm.make_input_fn(), RunContext(), seed=0)
    loads = costmodel.loads_from(captured)
    # (the alltoall route priced out: the sweep did not measure it; this is about the allgather)
    cluster = Cluster(hosts=8, bandwidth_bytes_per_s=costmodel.parse_rate("100mbit"), cores=2,
                      runtime_cpu_s=0.012, task_cpu_s=0.0037, rpc_overhead_s=0.00084, message_overhead_s=0.0005,
                      exchange_cpu_s=1.0)
    chosen = costmodel.choose(loads, cluster, compute_s=0.003)
    sparse = ("embedding", "softmax_w", "softmax_b")
    assert {name: chosen[name].route for name in sparse} == dict.fromkeys(sparse, "ps"), chosen
    gathered = {**chosen, "softmax_b": Choice("allreduce")}
    with_ps, with_allgather = (costmodel.predict(loads, c, cluster, 0.003) for c in (chosen, gathered))
    assert with_allgather.latency_s - with_ps.latency_s == pytest.approx(2 * 7 * 0.00084)

BUSY = "import time\nt = time.time()\nwhile time.time() - t < 3: pass"


def test_cpu_quota_per_host_slow_host_and_teardown():
    proc = _run(["tools.cluster", "--hosts=2", "--slow_hosts=1:4", "--", sys.executable, "-c", BUSY])
    assert proc.returncode == 0, proc.stderr[-3000:]
    if not (netns.have_root() and cpu_quota.available()):
        assert "no CPU quota" in proc.stderr
        return
    used = {int(h): (float(s), float(q)) for h, s, q in
            re.findall(r"h(\d) ([\d.]+)s/([\d.]+)cpu", proc.stderr)}
    cores = os.cpu_count()
    assert used[0][1] == pytest.approx(cores / 2, abs=0.01) and used[1][1] == pytest.approx(cores / 8, abs=0.01)
    # 3 s of spinning: host 0 may use its whole core; host 1 only a quarter of one
    assert used[0][0] > 2.0, used
    assert used[1][0] < 3 * cores / 8 + 0.3, used
    assert cpu_quota.existing_groups() == [] and netns.existing_namespaces() == []


def test_a_process_sizes_tf_pools_to_its_cgroup_quota_or_what_the_rig_says():
    if not (netns.have_root() and cpu_quota.available()):
        pytest.skip("needs root and the cgroup v1 cpu hierarchy")
    ask = "from parallax_tf import threads as p; print(p.available_cores(), p.choose('auto', 1))"
    try:
        cpu_quota.setup([0.5])                     # read from the process's own cgroup (no netns here)
        inside = subprocess.run(["sh", "-c", f"{cpu_quota.join_prefix(0)} {sys.executable} -c \"{ask}\""],
                                cwd=launch.ROOT, capture_output=True, text=True, timeout=120,
                                env=dict(os.environ, PYTHONPATH=launch.ROOT))
    finally:
        cpu_quota.teardown()
    assert inside.stdout.split() == ["0.5", "1"], inside.stderr[-2000:]
    # on emulated hosts `ip netns exec` hides /sys/fs/cgroup: tools.cluster says each host's share
    proc = _run(["tools.cluster", "--hosts=2", "--host_cpus=1.5", "--slow_hosts=1:3", "--", sys.executable, "-c", ask])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(re.findall(r"^(?:\[rank \d\] )?(\S+) (\d+)$", proc.stdout, re.M)) == [("0.5", "1"), ("1.5", "1")]


def test_thread_settings_share_the_cores_among_a_hosts_ranks(monkeypatch):
    from parallax_tf import threads as pool_threads
    monkeypatch.setenv(pool_threads.HOST_CPUS_ENV, "8")          # capped by the cores it may run on
    shared = max(1, min(8, len(os.sched_getaffinity(0))) // 3)
    assert [pool_threads.choose(s, 3) for s in ("auto", "tf", "5")] == [shared, 0, 5]
    monkeypatch.setenv(pool_threads.HOST_CPUS_ENV, "0.5")        # a fraction of a core: one thread
    assert pool_threads.choose("auto", 1) == 1
    for bad in ("0", "-2", "many"):
        with pytest.raises(ConfigError, match="--threads"):
            pool_threads.choose(bad, 1)


def test_cpu_quota_flags_are_checked():
    assert cpu_quota.quotas(4, "auto", {}, cores=2) == [0.5] * 4
    assert cpu_quota.quotas(2, "1.5", cpu_quota.parse_slow_hosts("1:3", 2)) == [1.5, 0.5]
    assert cpu_quota.quotas(2, "off", {}) is None
    for bad in ("2:4", "0:0.5", "x"):
        with pytest.raises(ValueError, match="--slow_hosts"):
            cpu_quota.parse_slow_hosts(bad, 2)
    with pytest.raises(ValueError, match="--host_cpus"):
        cpu_quota.quotas(2, "-1", {})
    with pytest.raises(ValueError, match="needs a CPU quota"):
        cpu_quota.quotas(2, "off", {1: 2.0})


def test_sweep_judges_auto_against_the_best_and_the_cost_model_against_the_run():
    from tools import sweep
    cell = {"model": "lm", "hosts": 8, "link": "10mbit", "predicted_s": {"auto": 0.5, "hybrid": 0.5, "horovod": 1.2},
            "results": {"auto": {"examples_per_s": 900.0, "step_s": 0.4}, "hybrid": {"examples_per_s": 1000.0,
                        "step_s": 0.4}, "horovod": {"examples_per_s": 300.0, "step_s": 1.0},
                        "tf_ps": {"error": "exit status 1"}}}
    verdict = sweep.judge(cell)
    assert verdict["best"] == "hybrid" and verdict["auto_vs_best"] == pytest.approx(0.9)
    assert verdict["model_errors"] == pytest.approx({"auto": 0.25, "hybrid": 0.25, "horovod": 0.2})
    row = sweep.table([cell]).splitlines()[1].split()
    assert row[:7] == ["lm", "8", "10mbit", "900", "1,000", "300", "failed"] and row[-6:] == [
        "-", "hybrid", "0.90", "+25%", "+25%", "+20%"]
    path = os.path.join(tempfile.mkdtemp(), "sweep.png")
    sweep.heat_map([cell, dict(cell, link="1gbit")], path)
    assert os.path.getsize(path) > 1000


def test_sweep_alternates_its_runs_and_compares_their_means(monkeypatch):
    from tools import sweep
    monkeypatch.setattr(sweep, "predictions", lambda *_: {"auto": 0.2, "hybrid": 0.3})
    order, steps = [], {"auto": [0.1, 0.3], "hybrid": [0.1, 0.1]}

    def run(strategy, *_, **__):
        order.append(strategy)
        if strategy == "tf_ps" and len(order) > 3:
            return {"error": "exit status 1"}          # its second run fails: the strategy failed
        step = steps.get(strategy, [0.5, 0.5])[sum(s == strategy for s in order) - 1]
        return {"step_s": step, "examples_per_s": 100 / step, "cpu_s_per_step_per_rank": step / 10}
    cell = sweep.run_cell(run, "lm", 2, "1gbit", ["auto", "hybrid", "tf_ps", "stanza"], 2)
    assert order == ["auto", "hybrid", "tf_ps"] * 2            # alternated; no stanza without an FC head
    auto = cell["results"]["auto"]
    assert auto["step_s"] == pytest.approx(0.2) and auto["examples_per_s"] == pytest.approx(500)
    assert auto["examples_per_s_each"] == pytest.approx([1000, 1000 / 3])
    assert auto["cpu_s_per_step_per_rank"] == pytest.approx(0.02)
    assert cell["results"]["tf_ps"] == {"error": "exit status 1"}
    assert sweep.spread(cell) == pytest.approx((1000 - 1000 / 3) / (2000 / 3))    # auto's runs: 100% apart
    assert sweep.judge(cell)["best"] == "hybrid" and sweep.judge(cell)["auto_vs_best"] == pytest.approx(0.5)
    assert sweep.table([cell]).splitlines()[1].split()[-6:] == ["100%", "hybrid", "0.50", "+0%", "+200%", "-"]
    with pytest.raises(SystemExit, match="--sweep_rounds=0"):
        sweep.run_cell(run, "lm", 2, "1gbit", ["auto"], 0)


def test_cpu_per_thread_name_from_a_given_step():
    import time
    from parallax_tf.runtime import thread_cpu
    from parallax_tf.runtime.hooks import StepStats
    stats = StepStats(profile_threads_from=1)
    stats.add(0.1, {}, 1)                    # step 1 completed: counting starts here
    began = time.process_time()
    while time.process_time() - began < 0.3:  # this (main) thread burns 0.3 s of CPU in "step 2"
        pass
    stats.add(0.3, {}, 1)
    per_step = stats.thread_cpu_per_step()
    assert 0.2 <= per_step["main"] <= 0.6, per_step
    assert sum(stats.cpu_times) >= 0.3                       # process CPU per step, all threads
    assert StepStats().thread_cpu_per_step() == {}           # off by default
    assert ("main" in {name for _, name in thread_cpu.snapshot()})


def _graph_bytes(summary: str) -> dict:
    """Per route, the bytes a step's graphs sent (all ranks), from a run's summary line (per rank,
    the mean over its ranks)."""
    units = {"B": 1, "KB": 1024, "MB": 1024 ** 2, "GB": 1024 ** 3}
    ranks, moved = re.search(r"\(mean over (\d+) ranks\): (.*?); checkpoint", summary).groups()
    return {route: float(n) * units[unit] * int(ranks)
            for route, n, unit in re.findall(r"(\w+) ([\d.]+)(B|KB|MB|GB)\b", moved)}


def test_flows_split_the_wire_bytes_by_kind_and_each_carries_its_route():
    out = os.path.join(tempfile.mkdtemp(), "flows.json")
    proc = _run(["tools.flows", "--hosts=2", "--bandwidth=100mbit", f"--json={out}", "--", sys.executable, "-m",
                 "models.lm", "--strategy=hybrid", "--steps=120", "--log_every=20"])
    if not netns.have_root():
        assert proc.returncode != 0 and "needs root" in proc.stderr
        return
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.load(open(out))
    assert data["steps"] == 80                      # from the 2nd progress line (step 40) to the last
    kinds = data["kinds"]
    assert set(kinds) == {"TF answers", "gRPC requests", "Horovod"}, kinds
    graph = _graph_bytes(re.search(r"the job's rank 0: (done: .*)", proc.stdout).group(1))
    # one rank per host: every route's bytes cross a link, with protocol framing on top; the window
    # opens and closes when rank 0 prints, while the steps go on (~35 ms each here)
    for which, routes, most in (("TF answers", ("ps_pull", "ps_push"), 1.15), ("Horovod", ("allreduce",), 1.25)):
        ratio = kinds[which]["bytes_sent"] * data["hosts"] / sum(graph[r] for r in routes)
        assert 0.93 <= ratio <= most, (which, routes, ratio)     # 0.93: a step or two of jitter
    assert 0 < kinds["gRPC requests"]["bytes_sent"] < 0.1 * kinds["TF answers"]["bytes_sent"]
    assert re.search(r"^headers \(est\.\)\s+[\d.]+ KB: on the wire [\d.]+ KB per step per rank", proc.stdout, re.M)


def test_gloo_frames_count_each_exchange_and_no_negotiation_once_cached():
    """mlp's table on the alltoall route, 2 hosts: each of a step's three exchanges is two gloo
    alltoalls (Horovod's of the splits, then the data), one message to the other rank each, and
    with a steady length Horovod's response cache answers them: no request gathered on rank 0."""
    out = os.path.join(tempfile.mkdtemp(), "frames.json")
    proc = _run(["tools.gloo_frames", "--hosts=2", "--bandwidth=100mbit", "--frames_hosts=0,1", f"--json={out}",
                 "--", sys.executable, "-m", "models.mlp", "--strategy=collective", "--steps=150", "--log_every=10"])
    if not netns.have_root():
        assert proc.returncode != 0 and "needs root" in proc.stderr
        return
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.load(open(out))
    assert data["steps"] >= 100, data["steps"]
    for host, kinds in data["hosts"].items():
        frames = {kind: counts[0] for kind, counts in kinds.items()}
        assert frames["alltoall: data"] == pytest.approx(6, abs=0.3), (host, frames)
        # every message's sender and receiver tell each other it is ready
        assert frames["alltoall: send ready"] == pytest.approx(6, abs=0.3), (host, frames)
        assert frames["alltoall: recv ready"] == pytest.approx(6, abs=0.3), (host, frames)
        assert frames.get("gather: data", 0) < 0.1, (host, frames)
        assert frames["allreduce: data"] >= 1, (host, frames)        # the dense gradient's ring
    assert "alltoall: data" in proc.stdout and "TCP acknowledgement" in proc.stdout


def test_a_run_whose_ranks_wrote_no_figures_is_an_error_not_a_crash(monkeypatch):
    from tools import bench
    monkeypatch.setattr(bench.cluster, "run", lambda *_, **__: 0)       # the launcher says 0, no rank wrote
    monkeypatch.setattr(bench, "model_flags", lambda: [])
    monkeypatch.setattr(bench, "FLAGS", type("Flags", (), {"host_cpus": "off", "slow_hosts": []})())
    got = bench.run_strategy("hybrid", 2, 1, "1gbit", "0ms", "lm", 5, 1)
    assert got == {"error": "exit status 0 but 0 of 2 ranks wrote their figures"}


def test_a_single_process_run_beside_a_cluster_counts_one_rank(monkeypatch):
    # `--hosts 8 --strategies hybrid,single`: the single run is one process, not 8 ranks
    from tools import bench
    monkeypatch.setattr(bench, "model_flags", lambda: [])

    def one_process(job, timeout):
        out = next(a.split("=", 1)[1] for a in job if a.startswith("--out="))
        with open(os.path.join(out, "rank0.json"), "w") as f:
            json.dump({"rank": 0}, f)
        return subprocess.CompletedProcess(job, 0)
    monkeypatch.setattr(bench.subprocess, "run", one_process)
    monkeypatch.setattr(bench, "summarise", lambda ranks: {"ranks": len(ranks)})
    assert bench.run_strategy("single", 8, 1, "10mbit", "0ms", "lm", 5, 1) == {"ranks": 1}


def test_rounds_keep_each_strategys_median_run_and_every_rounds_ratio():
    from tools import bench
    runs = {"hybrid": [{"examples_per_s": 100.0, "step_s": 1}, {"examples_per_s": 120.0, "step_s": 2},
                       {"examples_per_s": 90.0, "step_s": 3}],
            "horovod": [{"examples_per_s": 50.0}, {"error": "exit status 1"}, {"examples_per_s": 45.0}]}
    median = bench.median_run(runs["hybrid"])
    assert median["step_s"] == 1 and median["rounds_examples_per_s"] == [100.0, 120.0, 90.0]
    assert bench.median_run(runs["horovod"])["examples_per_s"] == 45.0       # a failed run counts as 0
    assert bench.rounds_lines(runs).splitlines() == [
        "hybrid examples/s by round: 100, 120, 90",
        "horovod examples/s by round: 50, 0, 45; vs hybrid by round: 0.50x, 0.00x, 0.50x"]
