"""Emulated hosts on one machine: a network namespace per host, each joined by a veth link to a
bridge in a namespace of its own, with bandwidth (tbf) and delay (netem) on both ends of every
link. Addresses come from 198.18.0.0/15 (reserved for benchmarking) and never leave the
namespaces; the launcher reaches the bridge through one more veth for Horovod's rendezvous.

Needs root. Set-up first removes anything a previous run left; teardown always runs."""
from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
from typing import List

PREFIX = "ptf"
# what a link's tbf queues, in seconds of its rate (parallax_tf.costmodel.PORT_QUEUE_S says the
# same: a fuller port drops, TCP incast; the launcher does not import TensorFlow to read it)
QUEUE_S = 0.2
BRIDGE_NS = f"{PREFIX}-br"
LAUNCHER_ADDRESS = "198.18.255.254"
HEADER_BYTES = 66      # per frame or segment on a link: Ethernet 14, IPv4 20, TCP 20 + 12 of timestamps


def host_ns(i: int) -> str:
    return f"{PREFIX}-h{i}"


def host_name(i: int) -> str:
    return f"h{i}"


def host_address(i: int) -> str:
    return f"198.18.{i // 250}.{i % 250 + 1}"


@dataclasses.dataclass
class Topology:
    hosts: int
    bandwidth: str = "100mbit"     # tc rate syntax
    delay: str = "1ms"             # one way, per link
    delay_applied: bool = True     # False when this kernel has no netem


def _ip(*args, ns=None, check=True):
    command = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    return subprocess.run(command, check=check, capture_output=True, text=True)


def teardown() -> None:
    """Removes every namespace, link and hosts file this module creates (idempotent)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        if name.startswith(f"{PREFIX}-"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
    # a setup stopped between creating a host's veth pair and moving it leaves it here
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.split("\n")
    for line in links:
        name = line.split(": ")[1].split("@")[0] if line.count(": ") >= 2 else ""
        if name.startswith(PREFIX):
            subprocess.run(["ip", "link", "del", name], capture_output=True)
    for entry in os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else []:
        if entry.startswith(f"{PREFIX}-"):
            shutil.rmtree(os.path.join("/etc/netns", entry), ignore_errors=True)


def setup(topo: Topology) -> None:
    teardown()
    subprocess.run(["ip", "netns", "add", BRIDGE_NS], check=True)
    _ip("ip", "link", "add", "br0", "type", "bridge", ns=BRIDGE_NS)
    _ip("ip", "link", "set", "br0", "up", ns=BRIDGE_NS)
    hosts_file = "127.0.0.1 localhost\n" + "".join(
        f"{host_address(i)} {host_name(i)}\n" for i in range(topo.hosts))
    for i in range(topo.hosts):
        ns, outside, inside = host_ns(i), f"{PREFIX}b{i}", f"{PREFIX}h{i}"
        subprocess.run(["ip", "netns", "add", ns], check=True)
        subprocess.run(["ip", "link", "add", inside, "type", "veth", "peer", "name", outside], check=True)
        subprocess.run(["ip", "link", "set", inside, "netns", ns, "name", "eth0"], check=True)
        subprocess.run(["ip", "link", "set", outside, "netns", BRIDGE_NS], check=True)
        _ip("ip", "link", "set", outside, "master", "br0", ns=BRIDGE_NS)
        _ip("ip", "link", "set", outside, "up", ns=BRIDGE_NS)
        _ip("ip", "addr", "add", f"{host_address(i)}/15", "dev", "eth0", ns=ns)
        _ip("ip", "link", "set", "eth0", "up", ns=ns)
        _ip("ip", "link", "set", "lo", "up", ns=ns)
        _shape("eth0", topo, ns)                 # host -> bridge
        _shape(outside, topo, BRIDGE_NS)         # bridge -> host
        os.makedirs(f"/etc/netns/{ns}", exist_ok=True)   # `ip netns exec` mounts it over /etc/hosts
        with open(f"/etc/netns/{ns}/hosts", "w") as f:
            # gloo looks up the machine's own hostname (shared by every namespace): inside host
            # i it must resolve to host i's address
            f.write(hosts_file + f"{host_address(i)} {socket.gethostname()}\n")
    # the launcher's own door to the bridge, for Horovod's rendezvous server (not shaped)
    subprocess.run(["ip", "link", "add", f"{PREFIX}-l0", "type", "veth", "peer", "name", f"{PREFIX}-l1"], check=True)
    subprocess.run(["ip", "link", "set", f"{PREFIX}-l1", "netns", BRIDGE_NS], check=True)
    _ip("ip", "link", "set", f"{PREFIX}-l1", "master", "br0", ns=BRIDGE_NS)
    _ip("ip", "link", "set", f"{PREFIX}-l1", "up", ns=BRIDGE_NS)
    subprocess.run(["ip", "addr", "add", f"{LAUNCHER_ADDRESS}/15", "dev", f"{PREFIX}-l0"], check=True)
    subprocess.run(["ip", "link", "set", f"{PREFIX}-l0", "up"], check=True)


def _shape(dev: str, topo: Topology, ns: str) -> None:
    _ip("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", topo.bandwidth,
        "burst", "64kb", "latency", f"{QUEUE_S * 1000:g}ms", ns=ns)
    if topo.delay in ("", "0", "0ms"):
        return
    delayed = _ip("tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem", "delay",
                  topo.delay, "limit", "100000", ns=ns, check=False)
    if delayed.returncode != 0:
        # Some kernels ship without sch_netem; bandwidth still applies, delay cannot.
        topo.delay_applied = False


def interface_bytes(i: int) -> dict:
    """tx/rx byte counters of host i's link."""
    out = {}
    for what in ("tx_bytes", "rx_bytes"):
        out[what] = int(_ip("cat", f"/sys/class/net/eth0/statistics/{what}", ns=host_ns(i)).stdout)
    return out


def have_root() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


def existing_namespaces() -> List[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    return [line.split(" ")[0] for line in listed if line.startswith(f"{PREFIX}-")]
