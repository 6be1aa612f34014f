"""Ranks on other hosts, started over ssh as horovodrun starts them: Horovod's own ssh check,
remote command and interface discovery.

Imports nothing but the standard library and Horovod's launcher (see launcher.py)."""
from __future__ import annotations

import dataclasses
import os
import shlex
import socket
from typing import List, Optional, Set, Tuple

if __package__:
    from parallax_tf.compat import horovod as horovod_runner
else:                  # the launcher run as a script: this folder is on the path, parallax_tf is not imported
    import importlib.util
    _SHIM_SPEC = importlib.util.spec_from_file_location(
        "parallax_tf_compat_horovod", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                   "compat", "horovod.py"))
    horovod_runner = importlib.util.module_from_spec(_SHIM_SPEC)
    _SHIM_SPEC.loader.exec_module(horovod_runner)

START_TIMEOUT_S = 60      # ssh checks and the interface discovery on every host, as horovodrun's --start-timeout


class RemoteHostError(Exception):
    """A host that ssh cannot reach, or no network interface all hosts share: the job cannot start."""


@dataclasses.dataclass(frozen=True)
class Ssh:
    """How to reach the hosts that are not this one (horovodrun's --ssh-port, --ssh-identity-file);
    anything else (user, jump hosts) comes from the user's ssh config."""
    port: Optional[int] = None
    identity_file: Optional[str] = None


def remote_hosts(names: List[str]) -> Set[str]:
    """The host names that are not addresses of this machine (a name that does not resolve is remote)."""
    return set(horovod_runner.remote_of(names))


def remote_command(command: str, host: str, ssh: Ssh) -> str:
    """`command` run on `host` through ssh, in this process's working directory (as Horovod's gloo
    launcher does: the hosts share the paths of the code and of its Python)."""
    # `; exit $?`: a rank killed by a signal ends the remote shell with 128+signal, as a local
    # rank's status says it; ssh alone would report 255, its own failure's status
    local = shlex.quote(f"cd {shlex.quote(os.getcwd())} > /dev/null 2>&1 ; {command} ; exit $?")
    return horovod_runner.ssh_command(local, host, ssh.port, ssh.identity_file)


def network(names: List[str], ssh: Ssh, timeout_s: float = START_TIMEOUT_S) -> Tuple[Set[str], str]:
    """(the interfaces the ranks' gloo uses, the address ranks reach this launcher's rendezvous at)
    for ranks on the hosts `names`: loopback when they are all this machine; else what Horovod
    finds on every host through ssh, and this machine's address on its route to the first remote
    host (the launcher need not share the ranks' interface names: a login node)."""
    remote = sorted(remote_hosts(names), key=names.index)
    if not remote:
        return {"lo"}, "127.0.0.1"
    if not horovod_runner.ssh_reaches(remote, ssh.port, ssh.identity_file):
        raise RemoteHostError(f"ssh cannot reach {', '.join(remote)} without a password: give each host "
                              "this machine's key (ssh-copy-id), or --ssh_port/--ssh_identity_file")
    try:
        nics = horovod_runner.common_interfaces(names, remote, ssh.port, ssh.identity_file, timeout_s)
    except Exception as err:       # Horovod raises bare Exception/RuntimeError when no interface is shared
        raise RemoteHostError(f"the hosts {', '.join(names)} share no routed network interface: {err}") from err
    return set(nics), route_address(remote[0])


def route_address(host: str) -> str:
    """This machine's address on its route to `host` (no packet is sent)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((socket.gethostbyname(host), 9))
        return probe.getsockname()[0]
    except OSError as err:
        raise RemoteHostError(f"no route from this machine to {host}: {err}") from err
    finally:
        probe.close()
