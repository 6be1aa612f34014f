"""Side-by-side benchmark of strategies on one emulated cluster.

    python -m tools.bench --hosts 8 --bandwidth 100mbit --model lm \\
        --strategies hybrid,horovod,horovod_dense,tf_ps --steps 30 --json out/bench.json

Every strategy trains the same model with the same per-rank batches on the same cluster, one
after another (`--rounds N`: N times, in alternation; the table holds each strategy's median
run). Prints a table (examples/s, step time, bytes per step on the wire, the plan's
lower bound, ratios to each baseline; CPU per step per rank: the process's, all threads, its PS
server's included, and that minus the single-process run's = the runtime's), writes JSON and a
PNG plot."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

from parallax_tf import flags as ptf_flags  # noqa: F401  (--steps and the other run flags)
from tools import cluster, netns
from tools import shared  # noqa: F401  (--model, --warmup)
from tools import sweep

flags.DEFINE_list("strategies", ["hybrid", "horovod", "horovod_dense", "tf_ps"], "What to compare.")
flags.DEFINE_integer("rounds", 1, "Runs of every strategy, in alternation (a, b, a, b): the table holds each "
                     "strategy's median run and a line gives every run's examples/s, for ratios near 1.")
flags.DEFINE_string("json", None, "Write the results here (and a PNG beside it).")
flags.DEFINE_integer("job_timeout_s", 600, "A strategy still running after this long is stopped and "
                     "reported as failed.")
FLAGS = flags.FLAGS
BASELINE_NAMES = ("horovod", "horovod_dense", "tf_ps", "tf_mwms")


def run_strategy(strategy: str, hosts: int, ranks_per_host: int, bandwidth: str, delay: str,
                 model: str, steps: int, warmup: int, timeout_s: int = 600, extra_flags=()) -> dict:
    """`extra_flags` are given to every rank after the ones tools.bench was given; so is each
    `+name=value` after the strategy's name (`hybrid+criteo_dynamic=true`)."""
    strategy, *variant = strategy.split("+")
    extra_flags = [f"--{given}" for given in variant] + list(extra_flags)
    out = tempfile.mkdtemp(prefix=f"bench-{strategy}-")
    job = [sys.executable, "-m", "tools.bench_job", f"--model={model}", f"--bench_strategy={strategy}",
           f"--steps={steps}", f"--warmup={warmup}", f"--out={out}", "--log_every=0"] + model_flags() \
        + list(extra_flags)
    if strategy == "single":
        try:
            status = subprocess.run(job, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            status = 124
    else:
        status = cluster.run(job, hosts, ranks_per_host, bandwidth, delay, timeout_s=timeout_s,
                             host_cpus=FLAGS.host_cpus, slow_hosts=FLAGS.slow_hosts)
    return _read(out, status, 1 if strategy == "single" else hosts * ranks_per_host)


def run_in_one_job(runs, hosts: int, bandwidth: str, steps: int, warmup: int, timeout_s: int = 0) -> list:
    """Each of `runs` ((strategy, model, flags) of parallax_tf strategies) one after another in
    the same ranks on `hosts` emulated hosts (one rank each): one start-up of the job for all of
    them. Returns their summaries (run_strategy's), in order; the flags hold for their run only.
    `timeout_s`: the whole job's bound (default: 600 s per run)."""
    out = tempfile.mkdtemp(prefix="bench-runs-")
    configs = [[f"--bench_strategy={strategy}", f"--model={model}", *given] for strategy, model, given in runs]
    job = [sys.executable, "-m", "tools.bench_job", f"--bench_runs={json.dumps(configs)}", f"--steps={steps}",
           f"--warmup={warmup}", f"--out={out}", "--log_every=0"] + model_flags()
    status = cluster.run(job, hosts, 1, bandwidth, "0ms", timeout_s=timeout_s or 600 * len(runs),
                         host_cpus=FLAGS.host_cpus, slow_hosts=FLAGS.slow_hosts)
    return [_read(os.path.join(out, str(i)), status, hosts) for i in range(len(runs))]


def _read(out: str, status: int, expected: int) -> dict:
    """The summary of the per-rank records a run left in `out`, or its error."""
    if status != 0:
        return {"error": f"exit status {status}"}
    ranks = [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out))] if os.path.isdir(out) else []
    if len(ranks) != expected:       # e.g. its ranks killed from outside, the launcher still 0
        return {"error": f"exit status 0 but {len(ranks)} of {expected} ranks wrote their figures"}
    return summarise(ranks)


def model_flags() -> list:
    """The reference models' flags and the strategies' options given to tools.bench, passed on
    to every job (so e.g. --slim_core or --cnn_fc_units reach the ranks)."""
    passed = []
    for name in FLAGS:
        if name.startswith(("slim_", "cnn_", "mlp_", "lm_", "recsys_", "criteo_", "staleness_", "max_staleness", "ps_plus_",
                            "stanza_", "fc_nodes", "dsp_", "stages", "threads")) and FLAGS[name].present:
            value = FLAGS[name].value
            passed.append(f"--{name}={','.join(map(str, value)) if isinstance(value, list) else value}")
    return passed


def summarise(ranks) -> dict:
    """Cluster-wide figures from the per-rank records (bytes are per rank per step)."""
    step_s = max(r["step_s"] for r in ranks)            # synchronous: the slowest rank sets the pace
    examples = ranks[0]["examples_per_step"]
    links = [r["link_bytes_per_step"] for r in ranks if r["link_bytes_per_step"]]
    link_mean = lambda key: sum(l.get(key, 0) for l in links) / len(ranks) if links else None  # noqa: E731
    wire, packets, retransmitted = link_mean("tx"), link_mean("tx_packets"), link_mean("tcp_retrans_segs")
    reported = [r["reported_bytes_per_step"] for r in ranks if r["reported_bytes_per_step"] is not None]
    lower = [r["lower_bound_bytes_per_step"] for r in ranks if r["lower_bound_bytes_per_step"] is not None]
    cpu = [r["cpu_s_per_step"] for r in ranks if r.get("cpu_s_per_step")]
    by_rank = {r["rank"]: r.get("cpu_s_per_step") for r in ranks}
    resent_by_rank = {r["rank"]: (r["link_bytes_per_step"] or {}).get("tcp_retrans_segs") for r in ranks}
    by_route = {}
    for r in ranks:
        for route, n in (r.get("bytes_by_route") or {}).items():
            by_route[route] = by_route.get(route, 0.0) + n / len(ranks)
    held_out = [r["held_out_loss"] for r in ranks if r.get("held_out_loss") is not None]
    threads = {}
    for r in ranks:
        for name, seconds in (r.get("thread_cpu_s_per_step") or {}).items():
            threads[name] = threads.get(name, 0.0) + seconds / len(ranks)
    return {"examples_per_s": examples / step_s if step_s else 0.0, "step_s": step_s,
            "pool_threads": sorted({r.get("pool_threads") for r in ranks}, key=str),
            "held_out_loss": held_out[0] if held_out else None, "bytes_by_route": by_route,
            "held_out_auc": next((r["held_out_auc"] for r in ranks if r.get("held_out_auc") is not None), None),
            "max_rss_mb": max((r.get("max_rss_mb") or 0) for r in ranks),
            "embedding_bytes_by_host": next((r["embedding_bytes_by_host"] for r in ranks
                                             if r.get("embedding_bytes_by_host")), None),
            "dynamic_rows_by_host": next((r["dynamic_rows_by_host"] for r in ranks
                                          if r.get("dynamic_rows_by_host")), None),
            "cpu_s_per_step_per_rank": sum(cpu) / len(cpu) if cpu else None,
            "cpu_s_per_step_by_rank": [by_rank[r] for r in sorted(by_rank)],
            "thread_cpu_s_per_step": dict(sorted(threads.items(), key=lambda item: -item[1])),
            "bytes_per_step": wire, "packets_per_step": packets, "retransmitted_segments_per_step": retransmitted,
            "retransmitted_segments_by_rank": [resent_by_rank[r] for r in sorted(resent_by_rank)],
            "reported_bytes_per_step": sum(reported) / len(reported) if reported else None,
            "lower_bound_bytes_per_step": sum(lower) / len(lower) if lower else None}


def median_run(done: list) -> dict:
    """The run of median examples/s (the lower middle one of an even count; a failed run counts
    as 0), with every run's examples/s beside it."""
    chosen = dict(sorted(done, key=_examples_per_s)[(len(done) - 1) // 2])
    chosen["rounds_examples_per_s"] = [_examples_per_s(r) for r in done]
    return chosen


def rounds_lines(runs: dict) -> str:
    """Each strategy's examples/s by round and, after the first strategy, its ratio to the
    first's run of the same round."""
    first = next(iter(runs))
    lines = []
    for strategy, done in runs.items():
        each = ", ".join(f"{_examples_per_s(r):,.0f}" for r in done)
        ratios = [f"{_examples_per_s(r) / _examples_per_s(base):.2f}x" if _examples_per_s(base) else "-"
                  for r, base in zip(done, runs[first])]
        beside = "" if strategy == first else f"; vs {first} by round: {', '.join(ratios)}"
        lines.append(f"{strategy} examples/s by round: {each}{beside}")
    return "\n".join(lines)


def _examples_per_s(run: dict) -> float:
    return run.get("examples_per_s", 0.0)


def table(results: dict) -> str:
    baselines = [b for b in BASELINE_NAMES if b in results and "error" not in results[b]]
    single = results.get("single", {}).get("cpu_s_per_step_per_rank")
    header = ["strategy", "examples/s", "step ms", "CPU ms/step/rank", "runtime CPU ms", "wire B/step/rank",
              "graph B/step", "dense B/step", "lower bound", "wire/LB", "held-out loss"] + [f"vs {b}" for b in baselines]
    rows = [header]
    for name, r in results.items():
        if "error" in r:
            rows.append([name, r["error"]] + [""] * (len(header) - 2))
            continue
        lb, wire = r.get("lower_bound_bytes_per_step"), r.get("bytes_per_step")
        routes = r.get("bytes_by_route") or {}
        dense = dense_bytes(routes)
        loss = r.get("held_out_loss")
        cpu = r.get("cpu_s_per_step_per_rank")
        rows.append([name, f"{r['examples_per_s']:,.0f}", f"{r['step_s'] * 1000:.1f}",
                     f"{cpu * 1000:.1f}" if cpu is not None else "-",
                     f"{(cpu - single) * 1000:.1f}" if cpu is not None and single is not None else "-", fmt_bytes(wire),
                     fmt_bytes(r.get("reported_bytes_per_step")), fmt_bytes(dense), fmt_bytes(lb),
                     f"{wire / lb:.2f}" if wire and lb else "-", f"{loss:.4f}" if loss is not None else "-"]
                    + [f"{r['examples_per_s'] / results[b]['examples_per_s']:.2f}x" for b in baselines])
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows)


def thread_lines(results: dict) -> str:
    """Each run's CPU per step per rank by thread name (threads nobody named carry the
    process's name: Horovod's background loop and Python's own threads among them)."""
    lines = []
    for name, r in results.items():
        threads = r.get("thread_cpu_s_per_step") or {}
        if threads:
            pools = "/".join(str(n or "TF's own") for n in r.get("pool_threads") or [])
            lines.append(f"{name} CPU ms/step/rank by thread ({pools} per TF pool): " + ", ".join(
                f"{thread} {seconds * 1000:.1f}" for thread, seconds in threads.items() if seconds >= 5e-5))
    return "\n".join(lines)


def wire_lines(results: dict) -> str:
    """Where each run's wire bytes go beyond what its graph sends: the frames' headers (a TSO/GSO
    frame counts once however many segments it carries) and the rest (retransmissions, RPC
    framing and control messages, Horovod's negotiation)."""
    lines = []
    for name, r in results.items():
        wire, packets, graph = r.get("bytes_per_step"), r.get("packets_per_step"), r.get("reported_bytes_per_step")
        if not wire or not packets:
            continue
        headers = packets * netns.HEADER_BYTES
        rest = f", other {fmt_bytes(wire - headers - graph)} beyond the graph's {fmt_bytes(graph)}" if graph else ""
        resent = r.get("retransmitted_segments_per_step")
        by_rank = r.get("retransmitted_segments_by_rank") or []
        resent = f"; TCP segments retransmitted {resent:,.1f}" + (
            f" (by rank: {' '.join(f'{n:.1f}' for n in by_rank)})" if by_rank and None not in by_rank else "") \
            if resent is not None else ""
        lines.append(f"{name} wire per step per rank: {fmt_bytes(wire)} in {packets:,.0f} frames "
                     f"(mean {wire / packets:,.0f} B): headers {fmt_bytes(headers)}{rest}{resent}")
    return "\n".join(lines)


def table_lines(results: dict) -> str:
    """Each run's embedding tables at the end, per parameter-server host, and its ranks' peak
    memory."""
    lines = []
    for name, r in results.items():
        held, rows = r.get("embedding_bytes_by_host"), r.get("dynamic_rows_by_host")
        auc = r.get("held_out_auc")
        if not held and not r.get("max_rss_mb"):
            continue
        line = f"{name}: peak RSS {r.get('max_rss_mb', 0):,.0f} MB/rank (max)"
        if auc is not None:
            line += f"; held-out AUC {auc:.4f}"
        if held:
            line += (f"; embedding state per host (PS shards and table copies) {' '.join(fmt_bytes(b) for b in held)} "
                     f"(total {fmt_bytes(sum(held))})")
        if rows:
            line += f"; dynamic rows per host {' '.join(f'{n:,}' for n in rows)} (total {sum(rows):,})"
        lines.append(line)
    return "\n".join(lines)


def dense_bytes(routes: dict):
    """Bytes per step of the dense variables' routes (None when the strategy reports none)."""
    return routes.get("allreduce", 0) + routes.get("significant", 0) if routes else None


def plot(results: dict, cluster_info: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [n for n, r in results.items() if "error" not in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(names, [results[n]["examples_per_s"] for n in names], color="tab:blue")
    left.set_ylabel("examples/s")
    right.bar(names, [(results[n]["bytes_per_step"] or 0) / 2**20 for n in names], color="tab:orange")
    right.set_ylabel("MB on the wire per step per rank")
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=30)
    fig.suptitle(f"{cluster_info['model']}: {cluster_info['hosts']} hosts x {cluster_info['ranks_per_host']} "
                 f"ranks, {cluster_info['bandwidth']} links")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def fmt_bytes(n):
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024


def main(argv):
    if FLAGS.sweep:
        sweep.main(run_strategy)
        return
    info = {"hosts": FLAGS.hosts, "ranks_per_host": FLAGS.ranks_per_host, "bandwidth": FLAGS.bandwidth,
            "delay": FLAGS.delay, "model": FLAGS.model, "steps": FLAGS.steps, "warmup": FLAGS.warmup}
    if FLAGS.rounds < 1:
        raise SystemExit(f"--rounds={FLAGS.rounds}: give 1 or more runs per strategy")
    runs = {strategy: [] for strategy in FLAGS.strategies}
    for round_ in range(FLAGS.rounds):
        for strategy in FLAGS.strategies:
            print(f"bench: {strategy} (round {round_ + 1}/{FLAGS.rounds}) ...", file=sys.stderr, flush=True)
            runs[strategy].append(run_strategy(strategy, FLAGS.hosts, FLAGS.ranks_per_host, FLAGS.bandwidth,
                                               FLAGS.delay, FLAGS.model, FLAGS.steps, FLAGS.warmup,
                                               FLAGS.job_timeout_s))
    results = {strategy: median_run(done) for strategy, done in runs.items()}
    print(table(results))
    if FLAGS.rounds > 1:
        print(rounds_lines(runs))
    print(thread_lines(results))
    print(wire_lines(results))
    print(table_lines(results))
    if FLAGS.json:
        os.makedirs(os.path.dirname(os.path.abspath(FLAGS.json)), exist_ok=True)
        with open(FLAGS.json, "w") as f:
            json.dump({"cluster": info, "results": results}, f, indent=1)
        plot(results, info, os.path.splitext(FLAGS.json)[0] + ".png")


if __name__ == "__main__":
    app.run(main)
