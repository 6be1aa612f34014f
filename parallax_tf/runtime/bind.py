"""Keeping the TF gRPC servers off every interface but the one the job uses.

TensorFlow's server always listens on the wildcard address. The shim built from
parallax_tf/native/bind_shim.c, preloaded into the rank, turns those wildcard binds (for the
ports this rank picked, and only those) into binds to the chosen address. The loader reads
LD_PRELOAD only when a program starts, so a rank without the shim re-executes itself once,
with the same arguments and environment, before Horovod or any server is started."""
from __future__ import annotations

import glob
import os
import socket
import sys

from parallax_tf.errors import ClusterError

ADDRESS_ENV, PORTS_ENV, REEXEC_ENV = "PARALLAX_BIND_ADDRESS", "PARALLAX_BIND_PORTS", "PARALLAX_BIND_REEXEC"
WILDCARDS = ("0.0.0.0", "::")


def choose_address(flag_address) -> str:
    """--bind_address, else loopback when every rank is on this host, else this host's address."""
    if flag_address:
        return flag_address
    sizes = [("HOROVOD_LOCAL_SIZE", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE")]
    for local, world in sizes:
        if world in os.environ:
            if os.environ.get(local) == os.environ[world]:
                return "127.0.0.1"
            host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
            try:
                return socket.gethostbyname(host)
            except OSError as err:
                raise ClusterError(f"cannot resolve this host's name {host!r}: {err}; pass --bind_address") from None
    return "127.0.0.1"


def restrict_servers_to(address: str) -> None:
    """Makes sure this process runs with the shim preloaded, re-executing it if needed."""
    if address in WILDCARDS:
        return                          # the user asked for every interface
    os.environ[ADDRESS_ENV] = address
    shim = _shim_path()
    if _preloaded(shim):
        return
    if not _may_reexecute():
        raise ClusterError(f"cannot restrict the TF servers to {address} in this process (interactive, "
                           f"or the preload of {shim} did not take). Run the training as a script, or "
                           "pass --bind_address=0.0.0.0 to accept connections on every interface")
    _reexecute_with(shim)


def preload_before_tensorflow() -> None:
    """A rank started by a launcher that did not preload the shim (horovodrun, mpirun)
    re-executes itself with it now, at `import parallax_tf`, rather than at run() after
    TensorFlow's import, which it would then repeat (seconds per rank). The shim stays inert
    until run() sets the address."""
    if not _may_reexecute():
        return
    try:
        shim = _shim_path()
    except ClusterError:
        return                          # run() says what is missing
    if not _preloaded(shim):
        _reexecute_with(shim)


def _preloaded(shim: str) -> bool:
    return shim in os.environ.get("LD_PRELOAD", "").split(":")


def _may_reexecute() -> bool:
    """A script started from its file, not re-executed yet (an interactive session cannot be)."""
    return not (os.environ.get(REEXEC_ENV) or sys.flags.interactive or not getattr(sys, "orig_argv", None)
                or not hasattr(sys.modules.get("__main__"), "__file__"))


def _reexecute_with(shim: str) -> None:
    """This process again, same arguments and environment, with the shim preloaded (once)."""
    env = dict(os.environ, **{REEXEC_ENV: "1"})
    env["LD_PRELOAD"] = ":".join(filter(None, [shim, os.environ.get("LD_PRELOAD")]))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def announce_ports(ports) -> None:
    """The shim rewrites wildcard binds only for these ports (read when each server binds)."""
    listed = [p for p in os.environ.get(PORTS_ENV, "").split(",") if p]
    os.environ[PORTS_ENV] = ",".join(listed + [str(p) for p in ports])


def preload_env(env: dict) -> dict:
    """`env` with the shim preloaded, for launchers: ranks then need no re-execution. The shim
    does nothing in a process that has not set PARALLAX_BIND_ADDRESS (the launcher itself)."""
    try:
        shim = _shim_path()
    except ClusterError:
        return env                      # each rank will say what is missing
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p != shim]
    return dict(env, LD_PRELOAD=":".join([shim] + preload))


def _shim_path() -> str:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = glob.glob(os.path.join(here, "_bindshim*.so"))
    if not found:
        raise ClusterError("parallax_tf's bind shim is not built (parallax_tf/_bindshim*.so); run "
                           "`make setup`, or pass --bind_address=0.0.0.0 to accept every interface")
    return found[0]
