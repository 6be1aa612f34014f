"""Run a command on an emulated multi-host cluster (one network namespace per host, and by
default one CPU quota per host).

    python -m tools.cluster --hosts 8 --bandwidth 100mbit --delay 1ms -- python -m models.lm

Ranks start inside their host's namespace through Horovod's gloo rendezvous (no ssh); each
rank's TF servers bind to its host's address. Each host's ranks share a CPU quota (cgroup v1
`cpu`): by default the machine's cores divided by the hosts, so a busy host cannot take
another's CPU; `--slow_hosts 7:4` gives host 7 a quarter of its share (a straggler). Without
root, says so and runs the ranks on plain loopback instead. The namespaces and groups are
removed afterwards, also on Ctrl-C or failure."""
from __future__ import annotations

import os
import sys
from typing import Dict, List, Optional

from absl import app, flags

from tools import cpu_quota, netns, ssh_hosts

flags.DEFINE_integer("hosts", 2, "Emulated hosts.")
flags.DEFINE_integer("ranks_per_host", 1, "Ranks started on each host.")
flags.DEFINE_string("bandwidth", "100mbit", "Per-link rate, each direction (tc syntax).")
flags.DEFINE_string("delay", "1ms", "Per-link one-way delay (tc syntax).")
flags.DEFINE_string("host_cpus", "auto", "CPUs each host may use: auto (the machine's cores / hosts), "
                    "off (no quota: hosts share every core) or a number.")
flags.DEFINE_float("cpu_period_ms", 100.0, "CFS period of the CPU quota: a host may use its share of it at once "
                   "(short periods throttle bursts too; the kernel needs a quota of at least 1 ms).")
flags.DEFINE_string("slow_hosts", "", "HOST:FACTOR,...: these hosts get 1/FACTOR of their CPU share.")
flags.DEFINE_bool("ssh", False, "Start an sshd on each host and the ranks through ssh, as parallax_tf's launcher "
                  "starts them on real hosts (--host_slots); hosts are then named by address.")
FLAGS = flags.FLAGS


def run(command: List[str], hosts: int, ranks_per_host: int = 1, bandwidth: str = "100mbit",
        delay: str = "1ms", env: Optional[dict] = None, on_ready=None, timeout_s: float = 0,
        host_cpus: str = "auto", slow_hosts: str = "", cpu_usage: Optional[Dict[int, float]] = None,
        max_restarts: int = 0, ckpt_dir: Optional[str] = None, min_np: Optional[int] = None,
        discovery: Optional[str] = None, ssh: bool = False) -> int:
    """Runs `command` on hosts x ranks_per_host ranks; returns the job's exit status.
    `on_ready()` is called once the network exists, before any rank starts. With `timeout_s`,
    ranks still running after that long are stopped and the job fails. `cpu_usage`, if given,
    receives the CPU seconds each host used. `max_restarts`: when a rank dies, the job starts
    again and resumes from the latest checkpoint in `ckpt_dir`, on the hosts `discovery` still
    lists (h0, h1, ...; all of them without it) if at least `min_np` ranks fit there. `ssh`: the
    ranks start through an sshd on each host (tools.ssh_hosts) and the hosts are named by address
    (198.18.0.1, ...), as real hosts would be; else they enter their host's namespace directly."""
    from parallax_tf import threads as pool_threads
    from parallax_tf.runtime import bind, launcher, quiet, remote
    env = bind.preload_env(quiet.environment(dict(os.environ if env is None else env, PYTHONUNBUFFERED="1"), False))
    shares = cpu_quota.quotas(hosts, host_cpus, cpu_quota.parse_slow_hosts(slow_hosts, hosts))
    if not netns.have_root():
        n = hosts * ranks_per_host
        print(f"tools.cluster: emulated hosts need root and iproute2 (uid {os.geteuid()}); falling back "
              f"to plain loopback: {n} ranks on this host, no bandwidth limit, no CPU quota",
              file=sys.stderr, flush=True)
        return launcher.run_restarting(command, f"localhost:{n}", n, env, {"lo"}, "127.0.0.1", max_restarts, ckpt_dir,
                                       min_np, discovery, timeout_s=timeout_s)
    if shares and not cpu_quota.available():
        print("tools.cluster: no cgroup v1 cpu/cpuacct hierarchy here; hosts share every core (no CPU quota)",
              file=sys.stderr, flush=True)
        shares = None
    topo = netns.Topology(hosts, bandwidth, delay)
    try:
        netns.setup(topo)
        if shares:
            period_ms = FLAGS.cpu_period_ms if FLAGS.is_parsed() else 100.0
            cpu_quota.setup(shares, int(period_ms * 1000))
        if not topo.delay_applied:
            print(f"tools.cluster: this kernel has no netem qdisc (sch_netem); links are limited to "
                  f"{bandwidth} but --delay={delay} is NOT applied", file=sys.stderr, flush=True)
        if on_ready:
            on_ready()
        # ranks report their host link's counters; --strategy=auto plans for the emulated links
        # (delay only where the kernel can apply it) and the cores all hosts share. A host with a
        # small CPU share takes long to import TensorFlow: gloo's rendezvous waits for it.
        emulated = dict(env, PARALLAX_LINK_IFACE="eth0", PARALLAX_LINK_BANDWIDTH=bandwidth,
                        HOROVOD_GLOO_TIMEOUT_SECONDS=env.get("HOROVOD_GLOO_TIMEOUT_SECONDS", "600"),
                        PARALLAX_LINK_DELAY=delay if topo.delay_applied else "0ms",
                        PARALLAX_CORES=str(os.cpu_count() or 1))

        def on_host(cmd, slot_info):
            host = int(slot_info.hostname[1:])
            return f"{host_prefix(host)}ip netns exec {netns.host_ns(host)} {host_env_words(host)}{cmd}"

        def host_prefix(host):
            return f"{cpu_quota.join_prefix(host)} " if shares else ""

        def host_env(host):
            # `ip netns exec` mounts a /sys of its own, without /sys/fs/cgroup: the rank learns its
            # host's quota from the environment (parallax_tf.threads)
            return {pool_threads.HOST_CPUS_ENV: f"{shares[host]:g}"} if shares else {}

        def host_env_words(host):
            return "".join(f"env {k}={v} " for k, v in host_env(host).items())

        restart = dict(max_restarts=max_restarts, ckpt_dir=ckpt_dir, min_np=min_np, discovery=discovery,
                       timeout_s=timeout_s)
        if ssh:
            names = [netns.host_address(i) for i in range(hosts)]
            with ssh_hosts.SshHosts(hosts, {h: host_prefix(h) for h in range(hosts)},
                                    {h: host_env(h) for h in range(hosts)}) as sshd:
                reach = remote.Ssh(identity_file=sshd.identity_file)
                nics, server_ip = remote.network(names, reach)
                status = launcher.run_restarting(command, ",".join(f"{n}:{ranks_per_host}" for n in names),
                                                 hosts * ranks_per_host, emulated, nics, server_ip, ssh=reach,
                                                 **restart)
        else:
            spec = ",".join(f"{netns.host_name(i)}:{ranks_per_host}" for i in range(hosts))
            status = launcher.run_restarting(command, spec, hosts * ranks_per_host, emulated, {"eth0"},
                                             netns.LAUNCHER_ADDRESS, wrap=on_host, **restart)
        if shares:
            used = cpu_quota.usage_s()
            if cpu_usage is not None:
                cpu_usage.update(used)
            print("tools.cluster: CPU seconds per host (quota " + ", ".join(
                f"h{h} {used.get(h, 0.0):.1f}s/{shares[h]:.2f}cpu" for h in range(hosts)) + ")",
                file=sys.stderr, flush=True)
        return status
    finally:
        netns.teardown()
        cpu_quota.teardown()


def main(argv):
    if len(argv) < 2:
        raise app.UsageError("give the command after --, e.g. python -m tools.cluster --hosts 2 -- "
                             "python -m models.mlp --steps 10")
    from parallax_tf.runtime import launch
    command = argv[1:]
    # the job's own restart flags decide, as under parallax_tf's local launcher
    restart = launch.restart_options(command)
    try:
        status = run(command, FLAGS.hosts, FLAGS.ranks_per_host, FLAGS.bandwidth, FLAGS.delay,
                     host_cpus=FLAGS.host_cpus, slow_hosts=FLAGS.slow_hosts, ssh=FLAGS.ssh, **restart)
    except ValueError as err:
        raise app.UsageError(str(err))
    sys.exit(status)


if __name__ == "__main__":
    app.run(main)
