"""Where a run's wire bytes go, by kind of connection. Runs a parallax_tf job on the emulated
cluster (tools.cluster) and reads every TCP connection's counters in each host's namespace
(`ss -tin`: payload bytes, segments, retransmissions) when rank 0 prints two progress lines, so
the difference covers whole steps:

    python -m tools.flows --hosts 8 --bandwidth 10mbit -- python -m models.lm --strategy=hybrid \
        --steps 150 --log_every 10

Kinds, from the TF servers' addresses the ranks print (PARALLAX_PRINT_ADDRESSES=1):
  TF answers        a TF server sending what another task fetches: pulled rows and the global
                    step from the PS state it holds, this rank's gradients and pushed rows for
                    PS state elsewhere (a rank's one server holds both: runtime.placement)
  gRPC requests     the client side: RunGraph and RecvTensor requests and HTTP/2 control
                    frames (flow-control window updates, pings)
  Horovod           every other connection between hosts (gloo: collectives, negotiation)
Connections within a host never reach a link and are left out. Headers are estimated at 66 B
a segment (Ethernet 14, IPv4 20, TCP 32 with timestamps); pure ACKs are segments too."""
from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

from absl import app, flags

from tools import cluster, netns  # noqa: F401  (tools.cluster defines --hosts, --bandwidth, ...)

flags.DEFINE_integer("skip_lines", 1, "Progress lines of rank 0 left out before the window opens (warm-up).")
flags.DEFINE_string("json", None, "Also write the per-kind figures here.")
FLAGS = flags.FLAGS

COUNTERS = ("bytes_sent", "bytes_retrans", "segs_out", "data_segs_out")
KINDS = ("TF answers", "gRPC requests", "Horovod")
_PROGRESS = re.compile(r"^step (\d+)/(\d+) ")       # rank 0's lines come through unprefixed
_ADDRESSES = re.compile(r"parallax_tf rank (\d+): worker (\S+?)(?:, ps (\S+))?$")


def snapshot(hosts: int) -> Dict[int, Dict[str, Dict[str, int]]]:
    """{host: {'local>peer': counters}} for every TCP connection in each host's namespace."""
    out = {}
    for host in range(hosts):
        text = subprocess.run(["ip", "netns", "exec", netns.host_ns(host), "ss", "-tinH"], capture_output=True,
                              text=True, timeout=30).stdout
        conns, current = {}, None
        for line in text.splitlines():
            head = re.match(r"^\S+\s+\d+\s+\d+\s+(\S+)\s+(\S+)", line)
            if head:     # ss prints IPv4-mapped addresses as [::ffff:a.b.c.d]
                current = ">".join(re.sub(r"\[::ffff:([\d.]+)\]", r"\1", a) for a in head.groups())
                conns[current] = {}
            elif current:
                conns[current].update({k: int(v) for k, v in re.findall(r"\b(\w+):(\d+)\b", line) if k in COUNTERS})
        out[host] = conns
    return out


def kind(local: str, peer: str, servers: set) -> Optional[str]:
    if local.rsplit(":", 1)[0] == peer.rsplit(":", 1)[0]:
        return None                                   # within a host
    if local in servers:
        return "TF answers"
    if peer in servers:
        return "gRPC requests"
    return "Horovod" if not peer.startswith(netns.LAUNCHER_ADDRESS) else None


def per_step(before, after, steps: int, servers: set) -> Dict[str, Dict[str, float]]:
    """Per step per host: each kind's counters between two snapshots (connections open at both)."""
    sums = collections.defaultdict(lambda: dict.fromkeys(COUNTERS, 0))
    for host, conns in after.items():
        for conn, counters in conns.items():
            old = before.get(host, {}).get(conn)
            which = kind(*conn.split(">"), servers) if old is not None else None
            if which:
                for key in COUNTERS:
                    sums[which][key] += counters.get(key, 0) - old.get(key, 0)
    scale = 1.0 / (steps * len(after))
    return {k: {key: value * scale for key, value in sums[k].items()} for k in KINDS if k in sums}


def table(figures: Dict[str, Dict[str, float]]) -> str:
    lines = [f"{'per step per rank':16s} {'payload KB':>10s} {'segments':>9s} {'of them data':>12s} "
             f"{'mean data seg B':>15s} {'retransmitted KB':>16s}"]
    total = {k: sum(f[k] for f in figures.values()) for k in COUNTERS}
    for name, f in list(figures.items()) + [("total", total)]:
        mean = f["bytes_sent"] / f["data_segs_out"] if f["data_segs_out"] else 0.0
        lines.append(f"{name:16s} {f['bytes_sent'] / 1e3:10.1f} {f['segs_out']:9.1f} {f['data_segs_out']:12.1f} "
                     f"{mean:15.0f} {f['bytes_retrans'] / 1e3:16.2f}")
    lines.append(f"headers (est.)   {total['segs_out'] * netns.HEADER_BYTES / 1e3:10.1f} KB: on the wire "
                 f"{(total['bytes_sent'] + total['segs_out'] * netns.HEADER_BYTES) / 1e3:.1f} KB per step per rank")
    return "\n".join(lines)


def run_window(command: List[str], hosts: int, bandwidth: str, delay: str, skip_lines: int, opened, closed,
               timeout_s: float = 900,
               progress_times: Optional[list] = None) -> Tuple[int, int, str, set, object, object]:
    """Runs `command` (a parallax_tf job printing progress lines) on the emulated cluster and
    calls `opened()` when rank 0 prints its progress line after `skip_lines` of them, `closed()`
    at its last (step == steps). Returns (exit status, steps between the two, the job's output,
    the TF servers' addresses the ranks printed, what opened() returned, what closed() did);
    steps 0 when the job printed no such two lines. `progress_times` receives (time, step) of every
    progress line as it is read."""
    launch = [sys.executable, "-m", "tools.cluster", f"--hosts={hosts}", f"--bandwidth={bandwidth}",
              f"--delay={delay}", "--"] + command
    env = dict(os.environ, PARALLAX_PRINT_ADDRESSES="1", PYTHONUNBUFFERED="1")
    servers, output = set(), []
    first = last = None                  # (step, what the callback returned)
    seen = 0
    with subprocess.Popen(launch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        try:
            for line in proc.stdout:
                output.append(line)
                line = line.rstrip("\n")
                address = _ADDRESSES.search(line)
                if address:
                    servers.update(a for a in address.groups()[1:] if a)
                progress = _PROGRESS.match(line)
                if progress:
                    seen += 1
                    step, steps = int(progress.group(1)), int(progress.group(2))
                    if progress_times is not None:
                        progress_times.append((time.time(), step))
                    if seen == skip_lines + 1:
                        first = (step, opened())
                    elif first and step == steps:
                        last = (step, closed())
            status = proc.wait(timeout=timeout_s)
        except BaseException:
            proc.kill()
            raise
    if not (first and last):
        return status or 1, 0, "".join(output), servers, first and first[1], None
    return status, last[0] - first[0], "".join(output), servers, first[1], last[1]


def measure(command: List[str], hosts: int, bandwidth: str, delay: str = "1ms", skip_lines: int = 1,
            timeout_s: float = 900) -> Tuple[int, Dict[str, Dict[str, float]], int, str]:
    """Runs `command` (a parallax_tf job printing progress lines) on the emulated cluster; returns
    (exit status, per-kind figures, steps in the window, the job's output)."""
    status, steps, output, servers, before, after = run_window(
        command, hosts, bandwidth, delay, skip_lines, lambda: snapshot(hosts), lambda: snapshot(hosts), timeout_s)
    if not steps:
        return status, {}, 0, output
    return status, per_step(before, after, steps, servers), steps, output


def main(argv):
    if len(argv) < 2:
        raise app.UsageError("give the job after --, e.g. -- python -m models.lm --strategy=hybrid --steps 150 "
                             "--log_every 10")
    if not netns.have_root():
        raise app.UsageError("tools.flows reads the emulated hosts' connections: it needs root (tools.cluster)")
    status, figures, steps, output = measure(argv[1:], FLAGS.hosts, FLAGS.bandwidth, FLAGS.delay, FLAGS.skip_lines)
    if not figures:
        sys.stdout.write(output[-4000:])
        print(f"tools.flows: no window of two progress lines (exit status {status}); give the job --log_every "
              "so that rank 0 prints at least two after the warm-up", file=sys.stderr)
        sys.exit(status or 1)
    done = re.findall(r"^(done: .*)$", output, re.M)
    print(f"the job's rank 0: {done[-1] if done else '(no summary line)'}")
    print(f"{FLAGS.hosts} hosts, {FLAGS.bandwidth}, {steps} steps counted:")
    print(table(figures))
    if FLAGS.json:
        with open(FLAGS.json, "w") as out:
            json.dump({"steps": steps, "hosts": FLAGS.hosts, "bandwidth": FLAGS.bandwidth, "kinds": figures}, out,
                      indent=1)
    sys.exit(status)


if __name__ == "__main__":
    app.run(main)
