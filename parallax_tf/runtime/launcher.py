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

The ranks' output is the job's one stream (rank_output.py). No rank outlives this launcher, nor
this launcher its front end, and their temporary folders go with them (lifeline.py)."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
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
    from parallax_tf.runtime import lifeline, remote
    from parallax_tf.runtime.rank_output import USER_ERROR_PREFIX, JobOutput, RankOutput
else:                  # run as a script (see above): its folder is on the path, parallax_tf is not imported
    import lifeline
    import remote
    from rank_output import USER_ERROR_PREFIX, JobOutput, RankOutput
    from remote import horovod_runner       # the shim, loaded by its path (remote.py)
if __name__ == "__mp_main__":        # this module re-imported in Horovod's per-rank helper process
    horovod_runner.install_rank_stop(lifeline.LAUNCHER_GONE_GRACE_S)

JOB_DIR_ENV = "PARALLAX_JOB_DIR"
COMMIT_DIR_ENV = "PARALLAX_COMMIT_DIR"    # where the ranks keep in-memory commits (parallax_tf.api)
EXPENDABLE_FILE = "expendable.json"
USER_ERROR_STATUS = 2
DIVERGED_STATUS = 3      # a rank whose loss became NaN/Inf (runtime/exit.py): restarting would diverge again
PEER_LOST_STATUS = 75    # a rank that stopped because a peer was lost (runtime/exit.py, watchdog.py)
CAUSE_WAIT_S = 5.0       # how long such a rank's exit waits for the lost peer's own to be seen


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


@dataclasses.dataclass
class _Job:
    """What the ranks' helper threads, the timer and the signal handler of one run() share."""
    job_dir: str
    output: JobOutput
    elsewhere: set                    # hosts reached over ssh
    wrap: Optional[Callable]
    ssh: Optional[remote.Ssh]
    failure: Optional[dict]
    stop_all: threading.Event         # set: every rank is being stopped
    # a SIGINT or SIGTERM to this process (the ranks' stop event too), and which signal(s)
    signalled: threading.Event = dataclasses.field(default_factory=threading.Event)
    received: List[int] = dataclasses.field(default_factory=list)
    # exit statuses of the ranks that ended the job, first first
    failures: List[int] = dataclasses.field(default_factory=list)
    # set: the rank that ended the job is in `failure`
    cause_known: threading.Event = dataclasses.field(default_factory=threading.Event)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def run(command: List[str], hosts: str, num_proc: int, env: dict, nics, server_ip: str,
        wrap: Optional[Callable] = None, timeout_s: float = 0, verbose: bool = False,
        failure: Optional[dict] = None, ssh: Optional[remote.Ssh] = None,
        front_end: Optional[lifeline.FrontEndLine] = None) -> int:
    """Runs `command` as `num_proc` ranks on `hosts` (Horovod's "h1:2,h2:2" syntax) and returns
    the job's status: the first failure of a rank the job could not lose, else 0. `wrap(cmd,
    slot_info)` may rewrite each rank's shell command (e.g. to enter a network namespace);
    `ssh`: how to reach the hosts that are not this machine (without it every rank starts here);
    `verbose`: the ranks' log lines are not filtered; `failure` is filled with the rank that
    ended the job, its host, its status and whether it reported a user error; `front_end`: the
    line from the `--np N` command that started this launcher (its end stops the job)."""
    if front_end and front_end.gone.is_set():      # between two runs: no ranks to start and stop again
        raise SystemExit(lifeline.FRONT_END_GONE_STATUS)
    elsewhere = remote.remote_hosts(list(host_slots(hosts))) if ssh else set()
    job_dir = tempfile.mkdtemp(prefix="parallax-job-")
    if front_end:
        front_end.remove_when_gone(job_dir)
    rank_lines = lifeline.RankLines.serve(job_dir, remove=[job_dir, env.get(COMMIT_DIR_ENV)],
                                          hold=front_end.socket.fileno() if front_end else None)
    env = dict(env, **{JOB_DIR_ENV: job_dir}, **(rank_lines.env() if rank_lines else {}))
    settings = types.SimpleNamespace(hosts=hosts, num_proc=num_proc, verbose=0, output_filename=None,
                                     elastic=False, prefix_output_with_timestamp=False)
    stop_all = threading.Event()
    job = _Job(job_dir, JobOutput(verbose, stop_all), elsewhere, wrap, ssh, failure, stop_all)
    timer = _start_timer(job, timeout_s) if timeout_s else None
    # Horovod's launch_gloo turns SIGINT and SIGTERM into an event that stops the ranks
    # (register_shutdown_event) and leaves its handler behind: the caller (tools.bench's next
    # strategy) would go on and ignore the next SIGTERM. Here the event is `signalled`, set by the
    # handler itself, so a signal is known as one whatever the ranks' exit statuses say; the
    # caller's handlers come back afterwards, and a signal ends the caller too.
    in_main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    if in_main:
        _catch_signals(job, previous)
    try:
        with front_end.stopping(stop_all) if front_end else contextlib.nullcontext():
            # exec_rank reports every rank as finished: the statuses that matter are in `failures`
            horovod_runner.launch_gloo(command, functools.partial(_exec_rank, job), settings, set(nics), env,
                                       server_ip, stop_event=job.signalled if in_main else None)
    finally:
        if in_main:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if timer:
            timer.cancel()
        if rank_lines:
            rank_lines.close()
        shutil.rmtree(job_dir, ignore_errors=True)
    if front_end and front_end.gone.is_set():      # its watch said so: the job ends here, not restarted
        raise SystemExit(lifeline.FRONT_END_GONE_STATUS)
    if job.signalled.is_set():
        signum = job.received[0] if job.received else signal.SIGTERM
        print(f"parallax_tf launcher: stopped every rank on {_signal_name(signum)}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)
    return job.failures[0] if job.failures else 0


def _start_timer(job: _Job, timeout_s: float) -> threading.Timer:
    """Stops every rank once the job has run for `timeout_s` (status 124)."""
    def expire():
        print(f"parallax_tf launcher: the job ran past {timeout_s:.0f}s; stopping every rank",
              file=sys.stderr, flush=True)
        with job.lock:
            job.failures.append(124)
        job.stop_all.set()
    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    return timer


def _catch_signals(job: _Job, previous: dict) -> None:
    """SIGINT and SIGTERM (the keys of `previous`) stop every rank and are remembered."""
    def on_signal(signum, _frame):
        job.received.append(signum)
        job.signalled.set()
        job.stop_all.set()
    for sig in previous:
        signal.signal(sig, on_signal)


def _exec_rank(job: _Job, cmd, slot_info, events):
    """Horovod's exec_command for one rank: runs it until it exits or the job stops, and decides
    what its exit means for the job. Always reports the rank as finished (0, 0.0)."""
    rank = slot_info.rank
    events = list(events or []) + [job.stop_all]
    errors = RankOutput(rank, sys.stderr, job.output, holds=True)
    if job.wrap:
        cmd = job.wrap(cmd, slot_info)
    if slot_info.hostname in job.elsewhere:
        cmd = remote.remote_command(cmd, slot_info.hostname, job.ssh)
    code = horovod_runner.execute(cmd, events, RankOutput(rank, sys.stdout, job.output), errors)
    errors.release(job_was_ending=job.stop_all.is_set())
    if code == 0:
        return 0, 0.0
    if job.signalled.is_set() or job.stop_all.is_set():      # stopped by a signal to us, or by us
        with job.lock:
            job.failures.append(code)
        return 0, 0.0
    survivable = _expendable(job.job_dir)
    if rank in survivable["ranks"]:
        print(f"parallax_tf launcher: rank {rank} on {slot_info.hostname} exited with status {code}; "
              f"the other ranks go on without it ({survivable['why']})", file=sys.stderr, flush=True)
        return 0, 0.0
    _rank_failed(job, rank, slot_info.hostname, code)
    job.stop_all.set()
    return 0, 0.0


def _rank_failed(job: _Job, rank: int, host: str, code: int) -> None:
    """Records a failed rank's status: first, with `failure` filled, when it is the job's cause."""
    if code == PEER_LOST_STATUS:      # the lost peer ended the job: its exit, if it exits, names the cause
        job.cause_known.wait(CAUSE_WAIT_S)
    with job.lock:
        is_cause = not job.cause_known.is_set()
        if is_cause:
            job.failures.insert(0, code)
            if job.failure is not None:
                job.failure.update(rank=rank, host=host, status=code,
                                   user_error=code == USER_ERROR_STATUS and rank in job.output.user_error_ranks)
            job.cause_known.set()
        else:
            job.failures.append(code)
    if is_cause and rank not in job.output.user_error_ranks:    # else its one line (user error, NaN) said why
        print(f"parallax_tf launcher: rank {rank} on {host} exited with status {code}; "
              "stopping the other ranks", file=sys.stderr, flush=True)


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
    if options.get("front_end"):
        options["front_end"].remove_when_gone(commits)
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
    parser.add_argument("--front_end_fd", type=int, default=None,
                        help="inherited descriptor of the line from the front end (lifeline.py): its end stops the job")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the rank's command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the rank's command after --")
    front_end = lifeline.FrontEndLine(args.front_end_fd).watch() if args.front_end_fd is not None else None
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
                          verbose=args.verbose, ssh=ssh, front_end=front_end)


if __name__ == "__main__":
    sys.exit(main())
