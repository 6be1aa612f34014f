"""Where a rank's CPU goes: CPU seconds of each of this process's threads (Linux /proc), grouped
by thread name (TF's executor pools, gRPC's, Horovod's background thread; "main" is the
Python thread, which also runs ops session.run executes inline)."""
from __future__ import annotations

import os
import re
from typing import Dict, Tuple

Snapshot = Dict[Tuple[int, str], float]


def stat_cpu_s(stat_text: str) -> float:
    """utime + stime of a /proc/<pid>[/task/<tid>]/stat line, in seconds."""
    fields = stat_text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def snapshot() -> Snapshot:
    pid, out = os.getpid(), {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:                 # no /proc: nothing to report
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                text = f.read()
        except OSError:             # the thread ended meanwhile
            continue
        name = "main" if int(tid) == pid else re.sub(r"[-_ ]?\d+$", "", text[text.index("(") + 1:text.rindex(")")])
        out[(int(tid), name)] = stat_cpu_s(text)
    return out


def since(before: Snapshot) -> Dict[str, float]:
    """CPU seconds per thread name used after `before` (threads started since count whole)."""
    grouped: Dict[str, float] = {}
    for key, seconds in snapshot().items():
        used = seconds - before.get(key, 0.0)
        if used > 0:
            grouped[key[1]] = grouped.get(key[1], 0.0) + used
    return dict(sorted(grouped.items(), key=lambda item: -item[1]))
