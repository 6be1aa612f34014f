"""The cost model's machine constants, measured by `python -m tools.calibrate` on the machine
the planner runs on and read back from a JSON file; the defaults when there is none.

Where the file is: --calibration, else $PARALLAX_CALIBRATION, else
~/.cache/parallax_tf/calibration.json."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from parallax_tf.errors import ConfigError

DEFAULT_PATH = os.path.join(os.path.expanduser("~"), ".cache", "parallax_tf", "calibration.json")


@dataclasses.dataclass
class Calibration:
    # CPU one rank spends per step besides its model's compute (TF's executor and session,
    # Horovod, the loop), more per other rank it runs with, more when its step goes through
    # TF's gRPC master (a plan with PS variables; others run in a session of their own
    # process), and per PS task its step runs a partition on
    runtime_cpu_s: float = 0.020
    peer_cpu_s: float = 0.0
    master_cpu_s: float = 0.0
    task_cpu_s: float = 0.0036
    # what a host's PS task spends per graph run it serves (a rank's partition of its step there)
    serve_cpu_s: float = 0.0
    # per byte a rank receives by allgather or PS (deserialised, expanded, summed, applied), and
    # per byte of a dense gradient's ring AllReduce (copied and summed in place)
    received_cpu_s_per_byte: float = 0.0
    ring_cpu_s_per_byte: float = 0.0
    # per byte of the dense variables a rank keeps a replica of (update, fusion buffer copies)
    replica_cpu_s_per_byte: float = 0.0
    # the alltoall route: per other rank when any table takes it (three exchanges a step, each
    # two gloo alltoalls with a message to every other rank: Horovod's and gloo's work for
    # them), and per table on it (its lookups' grouping, de-duplication and expansion); the
    # default per table is recsys' on 8 emulated hosts at 1 Gbit (collective against horovod)
    exchange_cpu_s: float = 0.0
    exchange_table_cpu_s: float = 0.6e-3
    # what a server spends per RPC it handles, and the fixed wall time of one PS round trip
    message_overhead_s: float = 150e-6
    rpc_overhead_s: float = 1e-3
    source: str = "defaults (no calibration file; run python -m tools.calibrate)"
    measured: dict = dataclasses.field(default_factory=dict)   # the runs the constants come from

    def constants(self) -> dict:
        return {f: getattr(self, f) for f in REQUIRED + LATER}


REQUIRED = ("runtime_cpu_s", "task_cpu_s", "message_overhead_s", "rpc_overhead_s")
# files written before these existed lack them: the defaults above (some have gather_cpu_s_per_byte, an
# allgather-only term that is ignored; before ring_cpu_s_per_byte the received term covered
# ring bytes too, so an older file leaves them free: calibrate again)
LATER = ("peer_cpu_s", "master_cpu_s", "received_cpu_s_per_byte", "ring_cpu_s_per_byte", "serve_cpu_s",
         "replica_cpu_s_per_byte", "exchange_cpu_s", "exchange_table_cpu_s")


def path(flag_value: Optional[str] = None) -> str:
    return flag_value or os.environ.get("PARALLAX_CALIBRATION") or DEFAULT_PATH


def load(where: Optional[str] = None) -> Calibration:
    """The calibration at `where` (see path()); the defaults when no file is there."""
    where = path(where)
    if not os.path.exists(where):
        return Calibration()
    try:
        with open(where) as f:
            data = json.load(f)
        got = Calibration(**{k: float(data[k]) for k in REQUIRED},
                          **{k: float(data.get(k, getattr(Calibration, k))) for k in LATER},
                          source=where, measured=data.get("measured", {}))
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"calibration file {where} is unreadable ({err!r}); run python -m tools.calibrate "
                          "again or delete it to use the defaults") from None
    negative = [k for k, v in got.constants().items() if not v >= 0]
    if negative:
        raise ConfigError(f"calibration file {where}: {', '.join(negative)} must be >= 0; run "
                          "python -m tools.calibrate again")
    return got


def save(calibration: Calibration, where: Optional[str] = None) -> str:
    where = path(where)
    os.makedirs(os.path.dirname(os.path.abspath(where)), exist_ok=True)
    with open(where, "w") as f:
        json.dump({**calibration.constants(), "measured": calibration.measured}, f, indent=1)
    return where
