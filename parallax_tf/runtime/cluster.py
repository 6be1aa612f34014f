"""Rank rendezvous through Horovod and the in-process TF gRPC servers.

Every rank runs one `worker` server (its session's target when its graph uses other tasks or
another rank's graph uses its worker: see session.alone); the first rank's server of each host
also holds the PS shards the plan puts on the host (runtime.placement). A caller may ask for a
further job with one task per host (`host_job`: tools/baselines.py's TF parameter servers). Addresses are
exchanged with Horovod's allgather, so no extra coordination service is needed.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import random
import socket
import sys
from typing import Dict, List, Optional

import tensorflow as tf

from parallax_tf.errors import ClusterError
from parallax_tf import devices
from parallax_tf import threads as pool_threads
from parallax_tf.runtime import bind, rank_objects
from parallax_tf.runtime.launch import under_launcher  # noqa: F401  (part of this module's interface)
from parallax_tf.runtime.topology import Topology


@dataclasses.dataclass
class Cluster:
    topology: Topology
    spec: Dict[str, List[str]]
    worker_server: object
    host_server: Optional[object]     # the task of `host_job` this process serves, if any
    devices: Optional[str] = None     # what GPU ranks compute on (devices.summary); None on the CPU
    # the pools and device of every session and server of this process
    process: pool_threads.ProcessConfig = pool_threads.ProcessConfig()

    @property
    def target(self) -> str:
        return self.worker_server.target

    @property
    def server_addresses(self) -> List[str]:
        """Per host, the address of the server holding parallax_tf's PS state (runtime.placement)."""
        return [self.spec["worker"][r] for r in self.topology.server_ranks]


_CLUSTER: Optional[Cluster] = None


def start_cluster(bind_address: Optional[str], base_port: Optional[int], verbose: bool = False,
                  threads: str = "auto", host_job: Optional[str] = None,
                  device_request: devices.DeviceRequest = devices.DeviceRequest()) -> Cluster:
    """Starts this rank's servers once per process; later runs in the process reuse them.
    `threads` (--threads) sizes TF's pools in this process's servers and sessions from here on,
    and `device_request` (--gpus_per_rank, ...) chooses the rank's device (parallax_tf.devices);
    `host_job`: each host's first rank also serves a task of this job (one task per host), for a
    caller that places ops by host (tools/baselines.py's TF parameter servers)."""
    global _CLUSTER
    if _CLUSTER is not None:
        return _CLUSTER
    address = bind.choose_address(bind_address)
    bind.restrict_servers_to(address)       # may re-execute this process, before Horovod starts
    hvd = _horovod()
    hvd.init()
    host_name = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
    cuda_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    choice = devices.choose(hvd.local_rank(), hvd.local_size(), devices.listed_gpus(), device_request, cuda_visible)
    peers = rank_objects.allgather({"rank": hvd.rank(), "host": host_name, "local_rank": hvd.local_rank(),
                                  "device": choice.device_type, "gpu": devices.physical_id(choice, cuda_visible),
                                  "port_base": default_port_base(hvd.local_size())})
    devices.check_agreement(peers, device_request.share)
    hosts: List[str] = []
    for peer in peers:
        if peer["host"] not in hosts:
            hosts.append(peer["host"])
    if address in bind.WILDCARDS:           # listening everywhere; peers need a real address
        address = "127.0.0.1" if len(hosts) == 1 else _address_of(host_name)
    # before this process's first server or session
    process = pool_threads.ProcessConfig(pool_threads.choose(threads, hvd.local_size()), choice)
    want = 2 if host_job and hvd.local_rank() == 0 else 1
    # without --port, the host's first rank's random start, each local rank in its own window
    base = base_port or next(p["port_base"] for p in peers if p["host"] == host_name and p["local_rank"] == 0)
    try:
        ports = free_ports(address, want, base, hvd.local_rank())
    except ClusterError:
        if base_port:
            raise
        ports = free_ports(address, want, None)     # that window is busy: any port the OS gives
    bind.announce_ports(ports)
    mine = {"rank": hvd.rank(), "host": host_name, "worker": f"{address}:{ports[0]}",
            "host_task": f"{address}:{ports[1]}" if want == 2 else None}
    everyone = sorted(rank_objects.allgather(mine), key=lambda p: p["rank"])
    spec = {"worker": [p["worker"] for p in everyone]}
    if host_job:
        spec[host_job] = [next(p["host_task"] for p in everyone if p["host"] == h and p["host_task"]) for h in hosts]
    topology = Topology(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(),
                        local_size=hvd.local_size(), host=hosts.index(host_name),
                        ranks_per_host=[sum(p["host"] == h for p in everyone) for h in hosts],
                        device_type=choice.device_type)
    worker = _server(spec, "worker", hvd.rank(), mine["worker"], process)
    host_server = _server(spec, host_job, hosts.index(host_name), mine["host_task"], process) \
        if mine["host_task"] else None
    rank_objects.allgather(True)  # every server is up before anyone opens a session
    if verbose or os.environ.get("PARALLAX_PRINT_ADDRESSES") == "1":   # tests read the ports from it
        print(f"parallax_tf rank {hvd.rank()}: worker {mine['worker']}"
              + (f", {host_job} {mine['host_task']}" if mine["host_task"] else ""), file=sys.stderr, flush=True)
    _CLUSTER = Cluster(topology, spec, worker, host_server,
                       devices.summary(choice, bool(hvd.nccl_built()), bool(hvd.cuda_built())), process)
    return _CLUSTER


PORT_WINDOW = 16   # ports each local rank may try from --port; windows never overlap
LOWEST_DEFAULT_PORT = 10000


def default_port_base(local_size: int) -> Optional[int]:
    """A random first port below the range the OS hands to outgoing connections, with room for a
    window per local rank; None where there is no room. A port probed free inside that range can
    be taken by one of the connections Horovod's gloo and gRPC open before the server binds it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768       # Linux's default
    top = ephemeral_low - local_size * PORT_WINDOW
    return random.SystemRandom().randrange(LOWEST_DEFAULT_PORT, top) if top > LOWEST_DEFAULT_PORT else None


def _horovod():
    try:
        import horovod.tensorflow as hvd
    except ImportError as err:
        raise ClusterError(f"Horovod's TensorFlow binding cannot be imported ({err}); build it with "
                           "`make setup` (tools/setup.sh, see BUILD.md) in the environment that runs "
                           "parallax_tf") from None
    return hvd


def free_ports(address: str, count: int, base: Optional[int], local_rank: int = 0) -> List[int]:
    """`count` free ports on `address`. With --port, local rank k searches only its own window
    [base + k*PORT_WINDOW, base + (k+1)*PORT_WINDOW), so ranks probing at once never collide;
    without it, the OS picks."""
    ports: List[int] = []
    start = base + local_rank * PORT_WINDOW if base else None
    candidate = start
    while len(ports) < count:
        if candidate is not None and (candidate >= start + PORT_WINDOW or candidate > 65535):
            raise ClusterError(f"local rank {local_rank} found fewer than {count} free port(s) on {address} "
                               f"in {start}..{start + PORT_WINDOW - 1} (from --port={base}); pass another --port")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, candidate or 0))
            except OSError as err:
                if err.errno == errno.EADDRINUSE and candidate is not None:
                    candidate += 1
                    continue
                raise ClusterError(f"cannot bind {address}:{candidate or 0}: {err}; check --bind_address") from err
            port = probe.getsockname()[1]
        if port not in ports:
            ports.append(port)
        candidate = port + 1 if candidate is not None else None
    return ports


def _server(spec, job: str, task: int, address: str, process: pool_threads.ProcessConfig):
    try:
        return tf.distribute.Server(tf.train.ClusterSpec(spec), job_name=job, task_index=task,
                                    protocol="grpc", config=process.proto(), start=True)
    except (tf.errors.UnknownError, tf.errors.InternalError) as err:
        raise ClusterError(f"could not start the {job} server on {address}: {err.message}. "
                           "Another process may have taken the port; pass --port to choose a range") from None


def _address_of(host_name: str) -> str:
    try:
        return socket.gethostbyname(host_name)
    except OSError as err:
        raise ClusterError(f"cannot resolve this host's name {host_name!r} to an address: {err}; "
                           "pass --bind_address") from None
