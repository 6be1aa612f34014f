"""Run a command on an emulated multi-host cluster (one network namespace per host).

    python -m tools.cluster --hosts 8 --bandwidth 100mbit --delay 1ms -- python -m models.lm

Ranks start inside their host's namespace through Horovod's gloo rendezvous (no ssh); each
rank's TF servers bind to its host's address. Without root, says so and runs the ranks on
plain loopback instead. The namespaces are removed afterwards, also on Ctrl-C or failure."""
from __future__ import annotations

import os
import sys
import threading
import types
from typing import List, Optional

from absl import app, flags

from tools import netns

flags.DEFINE_integer("hosts", 2, "Emulated hosts.")
flags.DEFINE_integer("ranks_per_host", 1, "Ranks started on each host.")
flags.DEFINE_string("bandwidth", "100mbit", "Per-link rate, each direction (tc syntax).")
flags.DEFINE_string("delay", "1ms", "Per-link one-way delay (tc syntax).")
FLAGS = flags.FLAGS


def run(command: List[str], hosts: int, ranks_per_host: int = 1, bandwidth: str = "100mbit",
        delay: str = "1ms", env: Optional[dict] = None, on_ready=None, timeout_s: float = 0) -> int:
    """Runs `command` on hosts x ranks_per_host ranks; returns the job's exit status.
    `on_ready()` is called once the network exists, before any rank starts. With `timeout_s`,
    ranks still running after that long are stopped and the job fails."""
    from parallax_tf.runtime import bind
    env = bind.preload_env(dict(os.environ if env is None else env, PYTHONUNBUFFERED="1"))
    if not netns.have_root():
        print(f"tools.cluster: emulated hosts need root and iproute2 (uid {os.geteuid()}); falling back "
              f"to plain loopback: {hosts * ranks_per_host} ranks on this host, no bandwidth limit",
              file=sys.stderr, flush=True)
        import subprocess
        n = hosts * ranks_per_host
        try:
            return subprocess.run([sys.executable, "-m", "horovod.runner.launch", "-np", str(n), "-H",
                                   f"localhost:{n}", "--gloo", *command], env=env, timeout=timeout_s or None).returncode
        except subprocess.TimeoutExpired:
            print(f"tools.cluster: the job ran past {timeout_s}s; stopped", file=sys.stderr, flush=True)
            return 124
    topo = netns.Topology(hosts, bandwidth, delay)
    try:
        netns.setup(topo)
        if not topo.delay_applied:
            print(f"tools.cluster: this kernel has no netem qdisc (sch_netem); links are limited to "
                  f"{bandwidth} but --delay={delay} is NOT applied", file=sys.stderr, flush=True)
        if on_ready:
            on_ready()
        # ranks report their host link's counters; --strategy=auto plans for the emulated links
        # (delay only where the kernel can apply it) and the cores all hosts share
        emulated = dict(env, PARALLAX_LINK_IFACE="eth0", PARALLAX_LINK_BANDWIDTH=bandwidth,
                        PARALLAX_LINK_DELAY=delay if topo.delay_applied else "0ms",
                        PARALLAX_CORES=str(os.cpu_count() or 1))
        return _launch(command, hosts, ranks_per_host, emulated, timeout_s)
    finally:
        netns.teardown()


def _launch(command, hosts, ranks_per_host, env, timeout_s: float = 0) -> int:
    from horovod.runner import gloo_run
    from horovod.runner.common.util import safe_shell_exec
    spec = ",".join(f"{netns.host_name(i)}:{ranks_per_host}" for i in range(hosts))
    settings = types.SimpleNamespace(hosts=spec, num_proc=hosts * ranks_per_host, verbose=0,
                                     output_filename=None, elastic=False, prefix_output_with_timestamp=False)
    failed = threading.Event()
    if timeout_s:
        def expire():
            print(f"tools.cluster: the job ran past {timeout_s}s; stopping every rank", file=sys.stderr, flush=True)
            failed.set()
        timer = threading.Timer(timeout_s, expire)
        timer.daemon = True
        timer.start()

    def exec_in_namespace(cmd, slot_info, events):
        host = int(slot_info.hostname[1:])
        code = safe_shell_exec.execute(f"ip netns exec {netns.host_ns(host)} {cmd}", index=slot_info.rank,
                                       events=list(events or []) + [failed])
        if code != 0:
            if not failed.is_set():
                print(f"tools.cluster: rank {slot_info.rank} on {slot_info.hostname} exited with status "
                      f"{code}; stopping the others", file=sys.stderr, flush=True)
            failed.set()
        return code, 0.0

    try:
        gloo_run.launch_gloo(command, exec_in_namespace, settings, {"eth0"}, env, netns.LAUNCHER_ADDRESS)
    except RuntimeError as err:             # Horovod's "one or more processes exited non-zero"
        print(f"tools.cluster: {str(err).splitlines()[0]}", file=sys.stderr, flush=True)
        return 1
    return 0


def main(argv):
    if len(argv) < 2:
        raise app.UsageError("give the command after --, e.g. python -m tools.cluster --hosts 2 -- "
                             "python -m models.mlp --steps 10")
    sys.exit(run(argv[1:], FLAGS.hosts, FLAGS.ranks_per_host, FLAGS.bandwidth, FLAGS.delay))


if __name__ == "__main__":
    app.run(main)
