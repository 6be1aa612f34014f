"""Starts a job's ranks through Horovod's gloo rendezvous and watches them.

    python parallax_tf/runtime/launcher.py --np 4 -- python train.py

Run as a script path, not `-m`: it imports nothing but the standard library and Horovod's
launcher, so the helper process Horovod spawns per rank (which re-imports the main module)
starts in a moment instead of importing TensorFlow.

Horovod's own launcher stops every rank when any rank fails. Here the job decides: once it
knows which ranks it can lose (a strategy whose ranks never wait for each other can lose any
rank that holds no server state), rank 0 writes them to $PARALLAX_JOB_DIR/expendable.json.
When one of those exits, the others go on and the job's status is theirs; when any other
rank fails, every rank is stopped, as horovodrun does. The rank named as the job's cause (and
restarted for) is the one that failed, not one that stopped because it lost that peer (status
PEER_LOST_STATUS): such a rank's exit waits a moment for the peer's own.

The ranks' output is the job's one stream (RankOutput): rank 0's lines as they are, another
rank's prefixed `[rank N]`, a user error every rank reports printed once, and TensorFlow's,
absl's, oneDNN's, gRPC's and Horovod's own log lines dropped unless --verbose."""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import types
from typing import Callable, List, Optional

if __package__:
    from parallax_tf.compat import horovod as horovod_runner
    from parallax_tf.runtime import remote
else:                  # run as a script (see above): its folder is on the path, parallax_tf is not imported
    import remote
    from remote import horovod_runner       # the shim, loaded by its path (remote.py)
if __name__ == "__mp_main__":        # this module re-imported in Horovod's per-rank helper process
    horovod_runner.quiet_rank_stop()

JOB_DIR_ENV = "PARALLAX_JOB_DIR"
COMMIT_DIR_ENV = "PARALLAX_COMMIT_DIR"    # where the ranks keep in-memory commits (parallax_tf.api)
EXPENDABLE_FILE = "expendable.json"
USER_ERROR_PREFIX = "parallax_tf: error: "    # a rank's one-line end on a user error (runtime/exit.py)
USER_ERROR_STATUS = 2
DIVERGED_STATUS = 3      # a rank whose loss became NaN/Inf (runtime/exit.py): restarting would diverge again
PEER_LOST_STATUS = 75    # a rank that stopped because a peer was lost (runtime/exit.py, watchdog.py)
CAUSE_WAIT_S = 5.0       # how long such a rank's exit waits for the lost peer's own to be seen
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


def write_expendable(ranks, why: str) -> None:
    """Called by rank 0 of a job started here: these ranks may die without stopping the job."""
    job_dir = os.environ.get(JOB_DIR_ENV)
    if not job_dir:
        return
    path = os.path.join(job_dir, EXPENDABLE_FILE)
    with open(path + ".tmp", "w") as out:
        json.dump({"ranks": sorted(ranks), "why": why}, out)
    os.replace(path + ".tmp", path)


def _expendable(job_dir: str) -> dict:
    try:
        with open(os.path.join(job_dir, EXPENDABLE_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"ranks": [], "why": ""}


def run(command: List[str], hosts: str, num_proc: int, env: dict, nics, server_ip: str,
        wrap: Optional[Callable] = None, timeout_s: float = 0, verbose: bool = False,
        failure: Optional[dict] = None, ssh: Optional[remote.Ssh] = None) -> int:
    """Runs `command` as `num_proc` ranks on `hosts` (Horovod's "h1:2,h2:2" syntax) and returns
    the job's status: the first failure of a rank the job could not lose, else 0. `wrap(cmd,
    slot_info)` may rewrite each rank's shell command (e.g. to enter a network namespace);
    `ssh`: how to reach the hosts that are not this machine (without it every rank starts here);
    `verbose`: the ranks' log lines are not filtered; `failure` is filled with the rank that
    ended the job, its host, its status and whether it reported a user error."""
    elsewhere = remote.remote_hosts(list(host_slots(hosts))) if ssh else set()
    job_dir = tempfile.mkdtemp(prefix="parallax-job-")
    env = dict(env, **{JOB_DIR_ENV: job_dir})
    settings = types.SimpleNamespace(hosts=hosts, num_proc=num_proc, verbose=0, output_filename=None,
                                     elastic=False, prefix_output_with_timestamp=False)
    stop_all = threading.Event()
    output = JobOutput(verbose, stop_all)
    signalled = threading.Event()     # a SIGINT or SIGTERM to this process (the ranks' stop event too)
    received: List[int] = []          # which signal(s)
    failures: List[int] = []          # exit statuses of the ranks that ended the job, first first
    cause_known = threading.Event()   # set: the rank that ended the job is in `failure`
    lock = threading.Lock()
    timer = None
    if timeout_s:
        def expire():
            print(f"parallax_tf launcher: the job ran past {timeout_s:.0f}s; stopping every rank",
                  file=sys.stderr, flush=True)
            with lock:
                failures.append(124)
            stop_all.set()
        timer = threading.Timer(timeout_s, expire)
        timer.daemon = True
        timer.start()

    def exec_rank(cmd, slot_info, events):
        rank = slot_info.rank
        events = list(events or []) + [stop_all]
        errors = RankOutput(rank, sys.stderr, output, holds=True)
        if wrap:
            cmd = wrap(cmd, slot_info)
        if slot_info.hostname in elsewhere:
            cmd = remote.remote_command(cmd, slot_info.hostname, ssh)
        code = horovod_runner.execute(cmd, events, RankOutput(rank, sys.stdout, output), errors)
        errors.release(job_was_ending=stop_all.is_set())
        if code == 0:
            return 0, 0.0
        if signalled.is_set() or stop_all.is_set():      # stopped by a signal to us, or by us
            with lock:
                failures.append(code)
            return 0, 0.0
        survivable = _expendable(job_dir)
        if rank in survivable["ranks"]:
            print(f"parallax_tf launcher: rank {rank} on {slot_info.hostname} exited with status {code}; "
                  f"the other ranks go on without it ({survivable['why']})", file=sys.stderr, flush=True)
            return 0, 0.0
        if code == PEER_LOST_STATUS:      # the lost peer ended the job: its exit, if it exits, names the cause
            cause_known.wait(CAUSE_WAIT_S)
        with lock:
            is_cause = not cause_known.is_set()
            if is_cause:
                failures.insert(0, code)
                if failure is not None:
                    failure.update(rank=rank, host=slot_info.hostname, status=code,
                                   user_error=code == USER_ERROR_STATUS and rank in output.user_error_ranks)
                cause_known.set()
            else:
                failures.append(code)
        if is_cause and rank not in output.user_error_ranks:    # else its one line (user error, NaN) said why
            print(f"parallax_tf launcher: rank {rank} on {slot_info.hostname} exited with status {code}; "
                  "stopping the other ranks", file=sys.stderr, flush=True)
        stop_all.set()
        return 0, 0.0

    # Horovod's launch_gloo turns SIGINT and SIGTERM into an event that stops the ranks
    # (register_shutdown_event) and leaves its handler behind: the caller (tools.bench's next
    # strategy) would go on and ignore the next SIGTERM. Here the event is `signalled`, set by the
    # handler itself, so a signal is known as one whatever the ranks' exit statuses say; the
    # caller's handlers come back afterwards, and a signal ends the caller too.
    in_main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    if in_main:
        def on_signal(signum, _frame):
            received.append(signum)
            signalled.set()
            stop_all.set()
        for sig in previous:
            signal.signal(sig, on_signal)
    try:
        # exec_rank reports every rank as finished: the statuses that matter are in `failures`
        horovod_runner.launch_gloo(command, exec_rank, settings, set(nics), env, server_ip,
                                   stop_event=signalled if in_main else None)
    finally:
        if in_main:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if timer:
            timer.cancel()
        shutil.rmtree(job_dir, ignore_errors=True)
    if signalled.is_set():
        signum = received[0] if received else signal.SIGTERM
        print(f"parallax_tf launcher: stopped every rank on {_signal_name(signum)}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)
    return failures[0] if failures else 0


def _signal_name(signum: int) -> str:
    return "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name


def run_restarting(command: List[str], hosts: str, num_proc: int, env: dict, nics, server_ip: str,
                   max_restarts: int = 0, ckpt_dir: Optional[str] = None, min_np: Optional[int] = None,
                   discovery: Optional[str] = None, **options) -> int:
    """run(), and when a rank dies (not of a user error) every rank is stopped and the job starts
    again, up to `max_restarts` times: it resumes from the latest checkpoint in `ckpt_dir`.
    `discovery` (--host_discovery_script, as Horovod's elastic mode takes it: a command printing
    one `host:slots` line per host that can take ranks now) is asked before each restart; a host
    it no longer lists is left out and the job goes on with fewer ranks while at least `min_np`
    (--min_np; default: as many as it started with) remain. Returns the last run's status."""
    restarts = []
    started = num_proc
    if min_np is not None and not 1 <= min_np <= num_proc:
        print(f"{USER_ERROR_PREFIX}--min_np={min_np}: give a rank count from 1 to the {num_proc} the job starts with",
              file=sys.stderr, flush=True)
        return USER_ERROR_STATUS
    # in-memory commits (--commit_every) outlive the ranks here, in memory where there is a tmpfs;
    # rank 0 writes them, so only when it runs on this machine
    commits = tempfile.mkdtemp(prefix="parallax-commits-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    if not (options.get("ssh") and remote.remote_hosts(list(host_slots(hosts))[:1])):
        env = dict(env, **{COMMIT_DIR_ENV: commits})
    try:
        while True:
            failure: dict = {}
            status = run(command, hosts, num_proc, env, nics, server_ip, failure=failure, **options)
            if status == 0 or not failure or failure["user_error"] or failure["status"] == DIVERGED_STATUS \
                    or len(restarts) >= max_restarts:
                break
            resume = max(latest_checkpoint_step(ckpt_dir), latest_checkpoint_step(commits))
            where = ""
            if discovery:
                found = discover_hosts(discovery, host_slots(hosts))
                if isinstance(found, str):
                    print(f"parallax_tf launcher: {found}; the job ends", file=sys.stderr, flush=True)
                    break
                left_out = [host for host in host_slots(hosts) if host not in found]
                ranks = min(sum(found.values()), started)
                if ranks < (min_np or started):
                    print(f"parallax_tf launcher: {', '.join(left_out) or 'no host'} did not come back: {ranks} "
                          f"rank(s) can start, fewer than --min_np={min_np or started}; the job ends",
                          file=sys.stderr, flush=True)
                    break
                if ranks != num_proc or left_out:
                    hosts, num_proc = placed_on(found, ranks), ranks
                    where = f" on {ranks} rank(s) of {', '.join(host_slots(hosts))}" + \
                        (f" ({', '.join(left_out)} left out)" if left_out else "")
            restarts.append(f"rank {failure['rank']} exited with status {failure['status']}, resumed at step "
                            f"{resume}{where}")
            print(f"parallax_tf launcher: restart {len(restarts)} of {max_restarts}: every rank starts again{where} and "
                  f"resumes from the latest checkpoint (step {resume})", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(commits, ignore_errors=True)
    if restarts:
        print(f"parallax_tf launcher: {len(restarts)} restart(s): " + "; ".join(restarts), file=sys.stderr, flush=True)
    return status


DISCOVERY_TIMEOUT_S = 60


def host_slots(hosts: str) -> dict:
    """Horovod's "h1:2,h2:2" as {"h1": 2, "h2": 2}."""
    found = {}
    for item in filter(None, hosts.split(",")):
        name, _, slots = item.strip().partition(":")
        found[name] = int(slots) if slots else 1
    return found


def placed_on(slots: dict, ranks: int) -> str:
    """A host list for `ranks` ranks, filling the hosts in order."""
    spec = []
    for name, count in slots.items():
        take = min(count, ranks - sum(n for _, n in spec))
        if take > 0:
            spec.append((name, take))
    return ",".join(f"{name}:{count}" for name, count in spec)


def discover_hosts(command: str, known: dict):
    """{host: slots} the discovery command lists now (a line "host:slots", or "host" for the slots
    it had), or one sentence saying why there is no answer."""
    try:
        proc = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=DISCOVERY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"the host discovery script ({command}) gave no answer within {DISCOVERY_TIMEOUT_S}s"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return f"the host discovery script ({command}) exited with status {proc.returncode}: {last}"
    found = {}
    for line in proc.stdout.split():
        name, _, slots = line.partition(":")
        if slots and not slots.isdigit():
            return f"the host discovery script ({command}) printed {line!r}; each line must be host:slots"
        found[name] = int(slots) if slots else known.get(name, 1)
    return found


def latest_checkpoint_step(ckpt_dir: Optional[str]) -> int:
    """The step of the newest complete checkpoint (parallax_tf.checkpoint's step-N folders); 0 if none."""
    try:
        names = os.listdir(ckpt_dir) if ckpt_dir else []
    except OSError:
        names = []
    steps = [int(m.group(1)) for m in map(re.compile(r"^step-(\d+)$").match, names) if m]
    return max(steps, default=0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, required=True, help="ranks")
    parser.add_argument("--host_slots", default=None, help="hosts and their slots, h1:4,h2:4 (default: this machine)")
    parser.add_argument("--ssh_port", type=int, default=None, help="ssh port of the other hosts")
    parser.add_argument("--ssh_identity_file", default=None, help="ssh key for the other hosts")
    parser.add_argument("--verbose", action="store_true", help="keep the ranks' log lines")
    parser.add_argument("--max_restarts", type=int, default=0, help="restarts after a rank dies")
    parser.add_argument("--ckpt_dir", default=None, help="where the job checkpoints (for the restart summary)")
    parser.add_argument("--min_np", type=int, default=None, help="fewest ranks a restart may go on with")
    parser.add_argument("--host_discovery_script", default=None, help="command listing the hosts a restart may use")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the rank's command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the rank's command after --")
    hosts = placed_on(host_slots(args.host_slots), args.np) if args.host_slots else f"localhost:{args.np}"
    slots = sum(host_slots(hosts).values())
    if slots < args.np:
        print(f"{USER_ERROR_PREFIX}--np={args.np} but --host_slots={args.host_slots} has {slots} slots: give each "
              "host its slots (host:slots) or fewer ranks", file=sys.stderr, flush=True)
        return USER_ERROR_STATUS
    ssh = remote.Ssh(args.ssh_port, args.ssh_identity_file)
    try:
        nics, server_ip = remote.network(list(host_slots(hosts)), ssh)
    except remote.RemoteHostError as err:
        print(f"{USER_ERROR_PREFIX}{err}", file=sys.stderr, flush=True)
        return USER_ERROR_STATUS
    return run_restarting(command, hosts, args.np, dict(os.environ), nics, server_ip,
                          args.max_restarts, args.ckpt_dir, args.min_np, args.host_discovery_script,
                          verbose=args.verbose, ssh=ssh)


if __name__ == "__main__":
    sys.exit(main())
