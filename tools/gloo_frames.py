"""What an emulated host's link carries, message by message: every frame a host sends over a
window of a job's steps, by gloo collective and gloo message, TCP's bare acknowledgements and
the rest (TF's gRPC, the launcher).

    python -m tools.gloo_frames --hosts 8 --bandwidth 10mbit --frames_hosts 0,3 -- \\
        python -m models.recsys --strategy=collective --steps 300 --log_every 50

Gloo's TCP transport sends each message as a 48-byte preamble (size, opcode, slot, offsets)
and its payload; the slot's top byte names the collective (allreduce, alltoall, gather,
broadcast, ...). Every send and every receive of an unbound buffer also notifies the peer
(NOTIFY_SEND_READY, NOTIFY_RECV_READY): one message is three frames, two of them bare
preambles. Horovod's negotiation is gloo too: gathers of the ranks' requests on rank 0 and
broadcasts of its response, each cycle whose collectives its response cache cannot answer.
Frames are read with an AF_PACKET socket inside each host's network namespace (root, as
tools.cluster), between rank 0's first progress line after --skip_lines once every capture
has begun and its last one; --json writes frames and bytes per step by host and kind."""
from __future__ import annotations

import collections
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

from absl import app, flags

from tools import cluster, netns  # noqa: F401  (tools.cluster defines --hosts, --bandwidth, --delay)
from tools.flows import run_window  # (also --skip_lines, --json)

flags.DEFINE_list("frames_hosts", ["0", "1"], "Hosts whose sent frames are counted (0: rank 0's).")
flags.DEFINE_string("frames_capture", None, "(internal) capture this interface's frames until SIGTERM, into "
                    "--frames_out.")
flags.DEFINE_string("frames_out", None, "(internal) where --frames_capture writes.")
FLAGS = flags.FLAGS

PREAMBLE = struct.Struct("<6Q")          # gloo transport/tcp/pair.h Op::preamble
COLLECTIVES = {1: "gather", 2: "allgather", 3: "reduce", 4: "allreduce", 5: "scatter", 6: "broadcast",
               7: "barrier", 8: "alltoall"}                          # gloo/types.h k*SlotPrefix
MESSAGES = {0: "data", 1: "data", 2: "send ready", 3: "recv ready"}   # Op::Opcode


def capture(iface: str, out: str) -> None:
    """Writes {"ready": when it began, "rows": [time, payload bytes, frame bytes, the payload's
    first 48 bytes (hex)] of every TCP frame this namespace sends on `iface`} until SIGTERM."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
    sock.bind((iface, 0))
    sock.settimeout(0.2)
    ready, rows = time.time(), []
    while not stop:
        try:
            frame, address = sock.recvfrom(65535)
        except socket.timeout:
            continue
        if address[2] != socket.PACKET_OUTGOING or frame[12:14] != b"\x08\x00" or frame[23] != 6:
            continue                                     # sent IPv4 TCP frames only
        ip_header = (frame[14] & 15) * 4
        tcp = 14 + ip_header
        payload_at = tcp + (frame[tcp + 12] >> 4) * 4
        payload = struct.unpack("!H", frame[16:18])[0] - (payload_at - 14)
        rows.append([time.time(), payload, len(frame), frame[payload_at:payload_at + PREAMBLE.size].hex()])
    with open(out, "w") as f:
        json.dump({"ready": ready, "rows": rows}, f)


def classify(rows: List[list]) -> Dict[str, List[float]]:
    """'collective: message' (or 'TCP acknowledgement', 'other') -> [frames, bytes]."""
    out = collections.defaultdict(lambda: [0, 0])
    for _, payload, size, head in rows:
        kind = "other"
        if payload == 0:
            kind = "TCP acknowledgement"
        elif len(head) == 2 * PREAMBLE.size:
            _, opcode, slot, *_ = PREAMBLE.unpack(bytes.fromhex(head))
            if opcode in MESSAGES and slot >> 56 in COLLECTIVES:
                kind = f"{COLLECTIVES[slot >> 56]}: {MESSAGES[opcode]}"
        out[kind][0] += 1
        out[kind][1] += size
    return dict(out)


def table(by_host: Dict[int, Dict[str, List[float]]], steps: int) -> str:
    kinds = sorted({k for kinds in by_host.values() for k in kinds},
                   key=lambda k: -max(kinds.get(k, [0, 0])[1] for kinds in by_host.values()))
    hosts = sorted(by_host)
    lines = [f"{'per step':28s}" + "".join(f"{f'host {h} frames':>15s}{'KB':>8s}" for h in hosts)]
    for kind in kinds + ["total"]:
        cells = []
        for h in hosts:
            frames, size = (by_host[h].get(kind, [0, 0]) if kind != "total" else
                            [sum(v[i] for v in by_host[h].values()) for i in (0, 1)])
            cells.append(f"{frames / steps:15.1f}{size / steps / 1e3:8.1f}")
        lines.append(f"{kind:28s}" + "".join(cells))
    return "\n".join(lines)


def main(argv):
    if FLAGS.frames_capture:
        capture(FLAGS.frames_capture, FLAGS.frames_out)
        return
    if len(argv) < 2:
        raise app.UsageError("give the job after --, e.g. -- python -m models.recsys --strategy=collective "
                             "--steps 300 --log_every 50")
    if not netns.have_root():
        raise app.UsageError("tools.gloo_frames reads the emulated hosts' frames: it needs root (tools.cluster)")
    hosts = [int(h) for h in FLAGS.frames_hosts]
    if any(not 0 <= h < FLAGS.hosts for h in hosts):
        raise app.UsageError(f"--frames_hosts={','.join(FLAGS.frames_hosts)}: hosts are 0 to {FLAGS.hosts - 1}")
    where = tempfile.mkdtemp(prefix="gloo-frames-")
    capturing, progress = [], []

    def opened():
        for h in hosts:
            capturing.append(subprocess.Popen(
                ["ip", "netns", "exec", netns.host_ns(h), sys.executable, "-m", "tools.gloo_frames",
                 "--frames_capture=eth0", f"--frames_out={os.path.join(where, f'{h}.json')}"]))

    def closed():
        for proc in capturing:
            proc.send_signal(signal.SIGTERM)
        for proc in capturing:
            proc.wait(timeout=60)

    status, steps, output, _, _, _ = run_window(argv[1:], FLAGS.hosts, FLAGS.bandwidth, FLAGS.delay,
                                                FLAGS.skip_lines, opened, closed, progress_times=progress)
    captured = {h: json.load(open(os.path.join(where, f"{h}.json"))) for h in hosts} if steps else {}
    # the window: from the first progress line after every capture began to the last one
    began = max((c["ready"] for c in captured.values()), default=None)
    inside = [(t, step) for t, step in progress if began is not None and t >= began]
    if len(inside) < 2:
        closed()
        sys.stdout.write(output[-4000:])
        print(f"tools.gloo_frames: no window of two progress lines after the captures began (exit status "
              f"{status}); give the job more steps or a smaller --log_every", file=sys.stderr)
        sys.exit(status or 1)
    (start, first), (end, last) = inside[0], inside[-1]
    by_host = {h: classify([row for row in c["rows"] if start <= row[0] <= end]) for h, c in captured.items()}
    print(f"{FLAGS.hosts} hosts, {FLAGS.bandwidth}, frames each host sent over {last - first} steps "
          "(headers included):")
    print(table(by_host, last - first))
    if FLAGS.json:
        with open(FLAGS.json, "w") as out:
            json.dump({"steps": last - first, "hosts": {h: {k: [v / (last - first) for v in counts]
                                                            for k, counts in kinds.items()}
                                                        for h, kinds in by_host.items()}}, out, indent=1)
    sys.exit(status)


if __name__ == "__main__":
    app.run(main)
