"""The ranks' output as the job's one stream (RankOutput): rank 0's lines as they are, another
rank's prefixed `[rank N]`, a user error every rank reports printed once, and TensorFlow's,
absl's, oneDNN's, gRPC's and Horovod's own log lines dropped unless --verbose.

Imports nothing but the standard library: the launcher runs as a script (see launcher.py)."""
from __future__ import annotations

import re
import threading
from typing import List, Optional

USER_ERROR_PREFIX = "parallax_tf: error: "    # a rank's one-line end on a user error (runtime/exit.py)

# Start-up notices and C++ log lines of TensorFlow, absl, oneDNN, gRPC and Horovod
NOISE = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|[IWE]\d{4} [\d:.]+ +\d+ \S+:\d+\] "                          # absl / glog format
    r"|\[?\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.[\d ]+: [IWE] \S+:\d+\] "     # TF's and Horovod's own (unpadded us)
    r"|To enable the following instructions: .*rebuild TensorFlow with the appropriate compiler flags"
    r"|Additional GRPC error information from remote target |:?UNKNOWN:Error received from peer "  # gRPC's, continued
    r"|Warning: Permanently added '[^']*' \(\S+\) to the list of known hosts"     # ssh's, on a host's first visit
    r"|bash: line \d+: +\d+ [A-Z][\w ]* +env HOROVOD_HOSTNAME=")    # a remote shell's note on a rank killed by a signal


PYTHON_WARNING = re.compile(r"\S+:\d+: \w*Warning: ")     # warnings.formatwarning's first line


def is_noise(line: str) -> bool:
    return NOISE.match(line) is not None


class JobOutput:
    """What the ranks' streams share: the user errors already printed, and who printed one."""

    def __init__(self, verbose: bool = False, stopping: Optional[threading.Event] = None):
        self.verbose = verbose
        self.stopping = stopping or threading.Event()     # set: the launcher is stopping the ranks
        self.lock = threading.Lock()
        self.errors: set = set()
        self.user_error_ranks: set = set()
        self.warnings: set = set()        # Python warnings already shown, by their text


class RankOutput:
    """One rank's stdout or stderr, written to `sink` as part of the job's one stream. From a
    traceback on, another rank's stderr is held until it exits (release): a rank that fails
    because the job was already ending (a peer's crash) adds its error's last line, and nothing
    after a peer's user error."""

    def __init__(self, rank: int, sink, job: JobOutput, holds: bool = False):
        self.rank, self.sink, self.job = rank, sink, job
        self.holds = holds and rank != 0
        self.held: Optional[List[str]] = None
        self.after_repeated_warning = False

    def write(self, text: str) -> None:
        line = text.rstrip("\r\n")
        if not self.job.verbose and (is_noise(line) or self.job.stopping.is_set() and _stopped_note(line)):
            return                      # (the shell's or the rank's note on a rank this launcher stopped)
        if self._repeats_a_warning(line):
            return
        if self.holds and self.job.errors and not line.startswith(USER_ERROR_PREFIX):
            return                      # a user error already said why the job ends
        if self.held is None and self.holds and line.startswith("Traceback (most recent call last)"):
            self.held = []
        if self.held is not None and not line.startswith(USER_ERROR_PREFIX):
            self.held.append(f"[rank {self.rank}] {text}")
            return
        if line.startswith(USER_ERROR_PREFIX):
            with self.job.lock:
                self.job.user_error_ranks.add(self.rank)
                if line in self.job.errors:
                    return              # every rank reports it: once is enough
                self.job.errors.add(line)
        elif self.rank != 0:
            text = f"[rank {self.rank}] {text}"
        self.sink.write(text)
        self.sink.flush()

    def _repeats_a_warning(self, line: str) -> bool:
        """A Python warning (`file:line: SomeWarning: text`, then its source line) that another
        rank, or this one, already showed: every rank runs the same code, so once is the job's."""
        if self.after_repeated_warning:
            self.after_repeated_warning = False
            if line.startswith("  "):
                return True
        if not PYTHON_WARNING.match(line):
            return False
        with self.job.lock:
            seen = line in self.job.warnings
            self.job.warnings.add(line)
        self.after_repeated_warning = seen
        return seen

    def flush(self) -> None:
        self.sink.flush()

    def release(self, job_was_ending: bool) -> None:
        """The rank exited: what it held is shown; if the job was already ending, only its last
        line (the error's message, e.g. which peer was lost), and nothing after a user error."""
        held, self.held = self.held or [], None
        if job_was_ending:
            held = held[-1:]
        if held and not self.job.errors:
            self.sink.write("".join(held))
            self.sink.flush()


def _stopped_note(line: str) -> bool:
    """The shell's or a rank's note that this launcher stopped it, saying nothing more (a note
    that names a lost peer stays: it says why the job ends)."""
    return line == "Terminated" or \
        re.match(r"parallax_tf rank \d+: the launcher is stopping the job \(SIGTERM\)\. Stopping", line) is not None
