"""An sshd on each emulated host (tools.netns), so that ranks start through ssh as on real hosts
(parallax_tf's launcher with --host_slots, horovodrun -H).

Each sshd listens on its host's address, port 22, inside the host's namespace (and CPU group),
and accepts one key made for the run; the host key is this machine's own, so ssh's known_hosts
stays valid from run to run. Needs root and openssh-server (tools/setup.sh installs it)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Dict, List, Optional

from tools import netns

SSHD = "/usr/sbin/sshd"
HOST_KEY = "/etc/ssh/ssh_host_ed25519_key"
READY_TIMEOUT_S = 20


class SshHosts:
    """Start with `with SshHosts(hosts, prefixes, host_env) as ssh_hosts:`; `identity_file` is the
    client key. `prefixes[i]`: shell words run before host i's sshd (its CPU group);
    `host_env[i]`: variables every session on host i gets (sshd's SetEnv)."""

    def __init__(self, hosts: int, prefixes: Optional[Dict[int, str]] = None,
                 host_env: Optional[Dict[int, Dict[str, str]]] = None):
        self.hosts, self.prefixes, self.host_env = hosts, prefixes or {}, host_env or {}
        self.folder = ""
        self.procs: List[subprocess.Popen] = []

    @property
    def identity_file(self) -> str:
        return os.path.join(self.folder, "id_ed25519")

    def __enter__(self) -> "SshHosts":
        if not os.access(SSHD, os.X_OK):
            raise RuntimeError(f"tools.ssh_hosts: no {SSHD}: install openssh-server (tools/setup.sh does, as root)")
        if not os.path.exists(HOST_KEY):
            subprocess.run(["ssh-keygen", "-A"], check=True, capture_output=True)
        self.folder = tempfile.mkdtemp(prefix="ptf-ssh-")
        try:
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.identity_file], check=True,
                           capture_output=True)
            shutil.copy(self.identity_file + ".pub", os.path.join(self.folder, "authorized_keys"))
            os.makedirs("/run/sshd", exist_ok=True)          # sshd's privilege separation directory
            for host in range(self.hosts):
                self.procs.append(subprocess.Popen(self._sshd(host), shell=True, stdout=subprocess.DEVNULL,
                                                   stderr=open(os.path.join(self.folder, f"sshd-h{host}.log"), "w"),
                                                   start_new_session=True))
            for host in range(self.hosts):
                self._wait_listening(host)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _sshd(self, host: int) -> str:
        options = {"ListenAddress": netns.host_address(host), "Port": "22", "HostKey": HOST_KEY,
                   "AuthorizedKeysFile": os.path.join(self.folder, "authorized_keys"), "StrictModes": "no",
                   "PasswordAuthentication": "no", "KbdInteractiveAuthentication": "no", "UsePAM": "no",
                   "PermitRootLogin": "prohibit-password", "PidFile": "none", "MaxStartups": "100",
                   "MaxSessions": "100", "LogLevel": "ERROR"}
        words = [SSHD, "-D", "-e", "-f", "/dev/null"] + [f"-o {key}={value}" for key, value in options.items()]
        words += [f"-o SetEnv={name}={value}" for name, value in self.host_env.get(host, {}).items()]
        prefix = self.prefixes.get(host)
        return f"{prefix + ' ' if prefix else ''}ip netns exec {netns.host_ns(host)} {' '.join(words)}"

    def _wait_listening(self, host: int) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:        # (this machine reaches every host's address, as the launcher does)
                socket.create_connection((netns.host_address(host), 22), 1).close()
                return
            except OSError:
                pass
            if self.procs[host].poll() is not None or time.monotonic() > deadline:
                with open(os.path.join(self.folder, f"sshd-h{host}.log")) as log:
                    raise RuntimeError(f"tools.ssh_hosts: the sshd of host {host} is not listening: "
                                       f"{log.read().strip()[-300:] or 'no output'}")
            time.sleep(0.1)

    def __exit__(self, *_) -> None:
        # every process in the hosts' namespaces: sshd forks each connection into a session of its
        # own, which would outlive the listener and, once the namespace is gone, hang its client
        for host in range(len(self.procs)):
            listed = subprocess.run(["ip", "netns", "pids", netns.host_ns(host)], capture_output=True, text=True)
            for pid in listed.stdout.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, 9)
        self.procs = []
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
