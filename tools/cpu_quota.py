"""A CPU quota per emulated host (cgroup v1 `cpu` controller), so a busy host cannot take
another's CPU, as on real machines; `cpuacct` beside it counts each host's CPU time.

Groups live under /sys/fs/cgroup/{cpu,cpuacct}/ptf/h<i>. A rank joins its host's group before
it starts (`join_prefix`), and its threads and children stay there. Needs root and a mounted
v1 `cpu` hierarchy; `available()` says whether both are there. Set-up first removes what a
previous run left; teardown always runs."""
from __future__ import annotations

import os
import time
from typing import Dict, List, Optional

ROOT = "/sys/fs/cgroup"
GROUP = "ptf"
PERIOD_US = 100_000
CONTROLLERS = ("cpu", "cpuacct")


def _dir(controller: str, host: Optional[int] = None) -> str:
    base = os.path.join(ROOT, controller, GROUP)
    return base if host is None else os.path.join(base, f"h{host}")


def available() -> bool:
    return os.geteuid() == 0 and all(os.path.isfile(os.path.join(ROOT, c, "cgroup.procs")) for c in CONTROLLERS) \
        and os.path.isfile(os.path.join(ROOT, "cpu", "cpu.cfs_quota_us"))


def parse_slow_hosts(text: str, hosts: int) -> Dict[int, float]:
    """'7:4,2:2' -> {7: 4.0, 2: 2.0}: host i gets 1/factor of its quota."""
    slow = {}
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        try:
            host, factor = item.split(":")
            host, factor = int(host), float(factor)
        except ValueError:
            raise ValueError(f"--slow_hosts takes HOST:FACTOR pairs such as 7:4, got {item!r}") from None
        if not 0 <= host < hosts or factor < 1:
            raise ValueError(f"--slow_hosts {item!r}: the host must be in 0..{hosts - 1} and the factor >= 1")
        slow[host] = factor
    return slow


def quotas(hosts: int, host_cpus: str, slow: Dict[int, float], cores: Optional[int] = None) -> Optional[List[float]]:
    """CPUs each host may use: `host_cpus` 'auto' (the machine's cores / hosts), 'off' (None: no
    quota) or a number; a slow host's share divided by its factor."""
    if host_cpus == "off":
        if slow:
            raise ValueError("--slow_hosts needs a CPU quota; drop --host_cpus=off")
        return None
    if host_cpus == "auto":
        share = (cores or os.cpu_count() or 1) / hosts
    else:
        try:
            share = float(host_cpus)
        except ValueError:
            share = -1.0
        if share <= 0:
            raise ValueError(f"--host_cpus takes auto, off or a positive number of CPUs, got {host_cpus!r}")
    return [share / slow.get(i, 1.0) for i in range(hosts)]


def setup(cpus_per_host: List[float], period_us: int = PERIOD_US) -> None:
    """A short period throttles a host within a burst too: with the default 100 ms a host that
    was idle may use both cores for its whole quota, i.e. run faster than its share while the
    others wait (a pipeline's stages take turns in a locked schedule)."""
    teardown()
    for controller in CONTROLLERS:
        for host in range(len(cpus_per_host)):
            os.makedirs(_dir(controller, host))
    for host, cpus in enumerate(cpus_per_host):
        # a quota below 1 ms per period is refused by the kernel
        quota = max(1000, int(round(cpus * period_us)))
        _write(os.path.join(_dir("cpu", host), "cpu.cfs_period_us"), period_us)
        _write(os.path.join(_dir("cpu", host), "cpu.cfs_quota_us"), quota)


def join_prefix(host: int) -> str:
    """Shell words that move the shell running a rank's command into host's groups (then `exec`
    the command, so the rank keeps the shell's process and its place)."""
    return " && ".join(f"echo $$ > {_dir(c, host)}/cgroup.procs" for c in CONTROLLERS) + " && exec"


def usage_s() -> Dict[int, float]:
    """CPU seconds each host's processes used since set-up."""
    out = {}
    base = _dir("cpuacct")
    for entry in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        if entry.startswith("h") and entry[1:].isdigit():
            with open(os.path.join(base, entry, "cpuacct.usage")) as f:
                out[int(entry[1:])] = int(f.read()) / 1e9
    return out


def teardown() -> None:
    """Moves any process still in a host group back to the root group and removes the groups
    (idempotent)."""
    for controller in CONTROLLERS:
        base = _dir(controller)
        if not os.path.isdir(base):
            continue
        for entry in os.listdir(base):
            path = os.path.join(base, entry)
            if not os.path.isdir(path):
                continue
            for _ in range(50):           # a process may still be exiting
                pids = open(os.path.join(path, "cgroup.procs")).read().split()
                for pid in pids:
                    try:
                        _write(os.path.join(ROOT, controller, "cgroup.procs"), pid)
                    except OSError:       # it exited meanwhile
                        pass
                try:
                    os.rmdir(path)
                    break
                except OSError:
                    time.sleep(0.1)
        try:
            os.rmdir(base)
        except OSError:
            pass


def existing_groups() -> List[str]:
    return [os.path.join(_dir(c), e) for c in CONTROLLERS if os.path.isdir(_dir(c)) for e in os.listdir(_dir(c))
            if os.path.isdir(os.path.join(_dir(c), e))]


def _write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))
