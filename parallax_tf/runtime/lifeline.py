"""No process of a job outlives the one above it, however that one dies.

`python train.py --np N` is three generations: the front end (that command, runtime/launch.py),
the launcher (runtime/launcher.py, in a session of its own) and the ranks (each under one of
Horovod's per-rank helper processes). A process killed by SIGKILL runs no handler, so each
generation holds a socket whose other end only the generation above holds: the kernel closes
that end when its process dies, whatever kills it, and the holder reads end-of-file. A socket
outlives exec and works on any Unix; PR_SET_PDEATHSIG is Linux's alone, and a rank's parent is
Horovod's helper, not the launcher.

- Front end and launcher share a socket pair (the front end's JobLine, the launcher's
  FrontEndLine: an inherited descriptor, --front_end_fd). End-of-file at the launcher: the front end is
  gone. The launcher says so in one line, stops every rank as on SIGTERM and exits, within
  FRONT_END_GONE_LIMIT_S whatever the ranks do.
- The launcher listens on a Unix socket in the run's folder (RankLines; $PARALLAX_LAUNCHER gives
  its host, pid and path). Every rank on the launcher's host connects at `import parallax_tf`
  (watch_launcher) and is handed the job's stderr (the launcher's own) and the launcher's end of
  the socket pair. End-of-file at a rank, or no one listening: the launcher is gone. The rank
  says so in one line on the job's stderr and exits (LAUNCHER_GONE_STATUS). Horovod's helper,
  which would SIGSTOP the rank at that moment and kill it silently seconds later, first gives
  it LAUNCHER_GONE_GRACE_S to end by itself (compat/horovod.py).
- Temporary folders (each run's /tmp/parallax-job-*, the job's /dev/shm/parallax-commits-*): the
  launcher removes them on its way out and names each to the front end as it makes it. As the
  launcher and every rank hold the launcher's end of the socket pair, the front end reads
  end-of-file only once all of them are gone (it waits JOB_GONE_WAIT_S at most, and says so);
  it then removes what is left (a launcher killed
  by SIGKILL removes nothing). A rank that finds its launcher gone removes them too as it
  exits: that covers a job without a front end (tools.cluster, `parallax_tf check`) or whose
  front end died with the launcher.

Ranks on other hosts hold no such line: their watchdog sees the launcher's rendezvous server
stop answering (runtime/watchdog.py). Ranks of horovodrun or mpirun hold none: no launcher of
ours started them.

Imports nothing but the standard library: the launcher runs as a script (see launcher.py)."""
from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import sys
import threading
import time
from typing import Iterable, List, Optional

LAUNCHER_ENV = "PARALLAX_LAUNCHER"     # "host:pid:socket path" of the launcher that started this rank
LAUNCHER_GONE_STATUS = 77              # a rank that stopped because its launcher is gone
FRONT_END_GONE_STATUS = 128 + signal.SIGHUP    # the launcher, once its front end is gone: a hang-up
FRONT_END_GONE_LIMIT_S = 15.0     # the launcher's longest stop after its front end is gone
LAUNCHER_GONE_GRACE_S = 5.0       # Horovod's helper lets a rank end by itself this long
JOB_GONE_WAIT_S = 15.0            # the front end's longest wait for the job's last process
STDERR_FD = 2                     # the launcher's own stderr is the job's: a rank's last line goes there


class JobLine:
    """The front end's end of its line to the job (a socket pair). The other end goes to the
    launcher (`launcher_fd`, inherited), which hands it on to every local rank."""

    def __init__(self):
        self._mine, self._theirs = socket.socketpair()

    def launcher_fd(self) -> int:
        return self._theirs.fileno()

    def launched(self) -> None:
        """The launcher holds its end now: this process must not, or it would never read its end."""
        self._theirs.close()

    def wait_and_clean_up(self, launcher_pid: int, launcher_status: Optional[int]) -> None:
        """After the launcher ended: waits (at most JOB_GONE_WAIT_S) until every process of the
        job has let go of its end, then removes the folders the launcher named. A launcher
        killed by a signal is named in one line."""
        named, gone = _read_until_closed(self._mine, JOB_GONE_WAIT_S)
        self._mine.close()
        for path in named:
            shutil.rmtree(path, ignore_errors=True)
        if launcher_status is not None and launcher_status < 0:
            ranks = "every rank has stopped" if gone else \
                f"a process of the job still runs after {JOB_GONE_WAIT_S:.0f}s"
            _say(f"parallax_tf: the launcher (pid {launcher_pid}) was killed by "
                 f"{signal.Signals(-launcher_status).name}; {ranks}")
        elif not gone:
            _say(f"parallax_tf: a process of the job still runs {JOB_GONE_WAIT_S:.0f}s after its launcher ended")


def _read_until_closed(line: socket.socket, timeout_s: float):
    """(the folders named on `line`, whether its other end was closed everywhere within timeout_s)."""
    received, deadline = b"", time.monotonic() + timeout_s
    while True:
        ready, _, _ = select.select([line], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            closed = False
            break
        try:
            chunk = line.recv(65536)
        except OSError:
            chunk = b""
        if not chunk:
            closed = True
            break
        received += chunk
    return [path for path in received.decode(errors="replace").split("\n") if path], closed


class FrontEndLine:
    """The launcher's end of the line from its front end (JobLine): the front end is gone when it
    reads end-of-file; it names its temporary folders on it."""

    def __init__(self, fd: int):
        os.set_inheritable(fd, False)      # the ranks get it through RankLines, nothing else may
        self.socket = socket.socket(fileno=fd)
        self.front_end_pid = os.getppid()
        self.gone = threading.Event()
        self._named: List[str] = []
        self._stops: List[threading.Event] = []
        self._lock = threading.Lock()

    def watch(self) -> "FrontEndLine":
        threading.Thread(target=self._watch, name="parallax-front-end-line", daemon=True).start()
        return self

    def remove_when_gone(self, path: str) -> None:
        """The front end removes `path` once the job is gone, if it is still there."""
        with self._lock:
            self._named.append(path)
        try:
            self.socket.sendall(path.encode() + b"\n")
        except OSError:
            pass                       # the front end is gone: the watch stops the job

    @contextlib.contextmanager
    def stopping(self, event: threading.Event):
        """Within the block, the front end's going sets `event`."""
        with self._lock:
            self._stops.append(event)
            if self.gone.is_set():
                event.set()
        try:
            yield
        finally:
            with self._lock:
                self._stops.remove(event)

    def _watch(self) -> None:
        try:
            while self.socket.recv(4096):
                pass                   # the front end never writes: any byte is ignored
        except OSError:
            pass
        _say(f"parallax_tf: the front end (pid {self.front_end_pid}) is gone: stopping the job")
        with self._lock:
            self.gone.set()
            for event in self._stops:
                event.set()
        limit = threading.Timer(FRONT_END_GONE_LIMIT_S, self._give_up)
        limit.daemon = True
        limit.start()

    def _give_up(self) -> None:
        """The ranks have not stopped in time: they find this launcher gone and stop themselves."""
        _say(f"parallax_tf: the job did not stop within {FRONT_END_GONE_LIMIT_S:.0f}s of its front end's end; "
             "the launcher leaves, and its ranks stop on their own")
        with self._lock:
            named = list(self._named)
        for path in named:
            shutil.rmtree(path, ignore_errors=True)
        os._exit(FRONT_END_GONE_STATUS)


class RankLines:
    """The launcher's end of its ranks' lines: a Unix socket in `folder`. Each rank that connects
    is handed the job's stderr and `hold` (the launcher's end of its front end's line, if any),
    with the folders to remove once the launcher is gone; its connection stays open until
    close() or this process's end."""

    def __init__(self, listener: socket.socket, path: str, remove: Iterable[str], hold: Optional[int]):
        self._listener, self.path = listener, path
        self._greeting = json.dumps({"remove": [p for p in remove if p]}).encode()
        self._fds = [STDERR_FD] + ([hold] if hold is not None else [])
        self._lines: List[socket.socket] = []
        self._closed = False
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, name="parallax-rank-lines", daemon=True).start()

    @classmethod
    def serve(cls, folder: str, remove: Iterable[str], hold: Optional[int]) -> Optional["RankLines"]:
        """None where no Unix socket can be made there (a path over the system's limit): the ranks
        then rely on Horovod's helper and their watchdog."""
        path = os.path.join(folder, "launcher.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(path)
            listener.listen(128)
        except OSError:
            listener.close()
            return None
        listener.settimeout(0.5)          # close() then ends the accept loop within this
        return cls(listener, path, remove, hold)

    def env(self) -> dict:
        """What a rank's environment needs to hold its line."""
        return {LAUNCHER_ENV: f"{socket.gethostname()}:{os.getpid()}:{self.path}"}

    def close(self) -> None:
        """The ranks of this run are gone: their lines close, and no new rank may connect."""
        with self._lock:
            self._closed = True
            self._listener.close()
            for line in self._lines:
                line.close()

    def _serve(self) -> None:
        while True:
            try:
                line, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return                 # closed
            with self._lock:
                if self._closed:
                    line.close()
                    return
                try:
                    socket.send_fds(line, [self._greeting], self._fds)
                    self._lines.append(line)
                except OSError:
                    line.close()


def watch_launcher() -> None:
    """In a rank that parallax_tf's launcher started on its own host: a thread that holds the
    rank's line to the launcher and, once the launcher is gone, says so and ends this process."""
    found = os.environ.get(LAUNCHER_ENV, "")
    host, _, rest = found.partition(":")
    pid, _, path = rest.partition(":")
    if not path or host != socket.gethostname() or _holding["launcher"]:
        return                         # no launcher of ours, one on another host (ssh), or held already
    _holding["launcher"] = True
    threading.Thread(target=_hold_launcher, args=(pid, path), name="parallax-launcher-line", daemon=True).start()


_holding = {"launcher": False}        # one line per process, whoever asks


def _hold_launcher(pid: str, path: str) -> None:
    line = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        line.connect(path)
        greeting, fds, _, _ = socket.recv_fds(line, 65536, 2)
    except OSError:
        greeting, fds = b"", []        # no one listens: the launcher is gone already
    # kept open for this process's life: the second is the front end's line, which this rank
    # holds so that the front end knows when the job's last process is gone
    for fd in fds:
        os.set_inheritable(fd, False)  # the rank's own children must not hold them
    stderr, remove = (fds or [STDERR_FD])[0], []
    if greeting:
        remove = json.loads(greeting)["remove"]
        try:
            while line.recv(4096):
                pass                   # the launcher never writes after its greeting
        except OSError:
            pass
    rank = os.environ.get("HOROVOD_RANK", "?")
    try:
        os.write(stderr, f"parallax_tf rank {rank}: the launcher (pid {pid}) is gone: stopping\n".encode())
    except OSError:
        pass
    for folder in remove:
        shutil.rmtree(folder, ignore_errors=True)
    os._exit(LAUNCHER_GONE_STATUS)


def _say(text: str) -> None:
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
