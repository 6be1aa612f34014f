"""The toolkit's options: the core's declared here as the strategies' are (dataclasses whose
fields name their absl flags, parallax_tf.strategy.option), grouped by concern; every flag parsed
in one place (resolve); keyword arguments of run() override."""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional

from absl import app, flags

from parallax_tf import strategy as strategy_lib
from parallax_tf import devices
from parallax_tf import threads as pool_threads
from parallax_tf.errors import ConfigError
from parallax_tf.runtime.script_args import toolkit_argv, users_program
from parallax_tf.runtime.launch import help_asked
from parallax_tf.strategy import option

FLAGS = flags.FLAGS


@dataclasses.dataclass
class LaunchOptions:
    """Where the ranks start (--np) and how a lost one is replaced."""
    np: Optional[int] = option(
        None, "np",
        "Ranks to launch when not under horovodrun/mpirun (on this machine, or on --host_slots).", kind="int")
    host_slots: Optional[str] = option(
        None, "host_slots",
        "With --np: the hosts to start the ranks on and their slots, h1:4,h2:4 (as horovodrun -H); other "
        "hosts are reached through ssh. Default: this machine.")
    ssh_port: Optional[int] = option(
        None, "ssh_port",
        "ssh port of the --host_slots hosts (default: ssh's).", kind="int")
    ssh_identity_file: Optional[str] = option(
        None, "ssh_identity_file",
        "ssh key for the --host_slots hosts (default: ssh's).")
    max_restarts: Optional[int] = option(
        None, "max_restarts",
        "Under --np: when a rank dies, stop every rank and start the job again from the latest checkpoint, up"
        " to this many times (default: 3 with --ckpt_dir, else 0).", kind="int")
    min_np: Optional[int] = option(
        None, "min_np",
        "A restart may go on with fewer ranks, down to this many, when a host the --host_discovery_script no "
        "longer lists is left out (default: as many as the job started with).", kind="int")
    host_discovery_script: Optional[str] = option(
        None, "host_discovery_script",
        "Command printing the hosts a restart may use, one host:slots a line (as horovodrun "
        "--host-discovery-script); without it a restart uses the same hosts.")
    commit_every: int = option(
        0, "commit_every",
        "Under parallax_tf's launcher: every this many steps, rank 0 also keeps the state a restart needs in "
        "memory (its host's /dev/shm, kept by the launcher across restarts), so a restart resumes from there "
        "unless rank 0's host was lost (0: off).")


@dataclasses.dataclass
class TrainingOptions:
    """The run itself."""
    steps: int = option(100, "steps", "Training steps.")
    log_every: int = option(10, "log_every", "Progress line every this many steps (rank 0); 0 turns it off.")
    plan_only: bool = option(False, "plan_only", "Print the plan and return without training.")
    shard_input: bool = option(
        True, "shard_input",
        "A tf.data pipeline built inside model_fn that does not depend on the rank is read by each data rank "
        "in turn (rank r of N takes batches r, r+N, ...: the job's global batch is the single-device script's "
        "next N batches); one the script splits by rank itself is read as built (the plan's `input` lines say "
        "which); --noshard_input: every rank reads every pipeline whole.")
    shard_reading: bool = option(
        False, "shard_reading",
        "A TF2 step's dataset (ptf.run(train_step, dataset)): each data rank reads its own shard "
        "(dataset.shard(N, r)) and trains on its whole element, so a step trains on N consecutive elements "
        "joined (N times the batch, 1/N of the steps per pass). Default: every rank reads every element and "
        "feeds its share of it (the single-device script's batch per step).")
    seed: int = option(0, "seed", "Graph-level random seed (tf.compat.v1.set_random_seed) every rank builds model_fn "
                       "under; a single-device script compared with the run sets the same before building.")
    timeout_s: int = option(120, "timeout_s", "Longest any cross-rank wait may take before the run fails.")


@dataclasses.dataclass
class PlanningOptions:
    """What the planner and its cost model assume."""
    partitions: Optional[int] = option(
        None, "partitions",
        "Shards for every sparse PS variable (default: the count with the shortest step the cost model "
        "predicts).", kind="int")
    dynamic_tables: Optional[str] = option(
        None, "dynamic_tables",
        "Where dynamic tables (ptf.DynamicEmbedding) live: servers (sharded by id over the parameter-server "
        "hosts) or replicated (every rank holds each whole table; the ranks' pushes are allgathered and every "
        "rank applies them to its copy). Default: --strategy=auto's cost model chooses per table, other "
        "strategies use servers.", choices=["servers", "replicated"])
    local_aggregation: bool = option(
        True, "local_aggregation",
        "Sum sparse gradients of a host's ranks before sending.")
    calibration: Optional[str] = option(
        None, "calibration",
        "The cost model's machine constants, written by python -m tools.calibrate (default: "
        "$PARALLAX_CALIBRATION, else ~/.cache/parallax_tf/calibration.json; built-in defaults when there is "
        "no file).")
    link_bandwidth: Optional[str] = option(
        None, "link_bandwidth",
        "Per-host link rate the cost model plans for (e.g. 10gbit; default: $PARALLAX_LINK_BANDWIDTH, else "
        "10gbit).")
    link_delay: Optional[str] = option(
        None, "link_delay",
        "One-way per-link delay the cost model plans for (default: $PARALLAX_LINK_DELAY, else 0.05ms).")
    host_cores: Optional[int] = option(
        None, "host_cores",
        "Cores per host the cost model plans for (default: $PARALLAX_CORES, else the calibration's).", kind="int")


@dataclasses.dataclass
class ProcessOptions:
    """Each rank's servers, thread pools and logs."""
    port: Optional[int] = option(
        None, "port",
        "First port to try for the TF servers (default: a free port below the range the OS gives "
        "outgoing connections).", kind="int")
    bind_address: Optional[str] = option(
        None, "bind_address",
        "Address the TF servers bind to (default: loopback when all ranks are on one host, else the host's "
        "address).")
    threads: str = option(
        'auto', "threads",
        "Threads in each of TensorFlow's pools (inter- and intra-op) per rank: auto (the cores its cgroup "
        "quota or CPU affinity allows, shared by the ranks of its host), tf (TensorFlow's own sizing: every "
        "core of the machine), or a number.")
    verbose: bool = option(
        False, "verbose",
        "Show TensorFlow's and Horovod's own logs and each rank's server addresses.")


@dataclasses.dataclass
class CheckpointOptions:
    """Checkpoints."""
    ckpt_dir: Optional[str] = option(None, "ckpt_dir", "Write checkpoints here and resume from the latest one.")
    ckpt_every: int = option(0, "ckpt_every", "Checkpoint every this many steps (0: only by time/at the end).")
    ckpt_secs: float = option(0, "ckpt_secs", "Checkpoint at most this many seconds apart (0: off).", kind="float")
    ckpt_keep: int = option(3, "ckpt_keep", "Checkpoints kept; older ones are deleted.")


@dataclasses.dataclass
class ObservationOptions:
    """What a run records beyond its progress line."""
    logdir: Optional[str] = option(None, "logdir", "TensorBoard event files (loss, throughput, bytes per route).")
    # Not `--timeline`: horovodrun's argparse takes any prefix of its own --timeline-filename from
    # the script's arguments too, so that name cannot reach the ranks.
    timeline_file: Optional[str] = option(
        None, "timeline_file",
        "Chrome trace of the --timeline_steps steps (PATH) plus Horovod's timeline (PATH.horovod.json).")
    timeline_steps: list = option(['3', '4'], "timeline_steps", "Steps (0-based) traced by --timeline_file.")
    profile_threads_from: int = option(
        -1, "profile_threads_from",
        "From this step on, count this process's CPU per thread name (TF's pools, gRPC's, Horovod's, the "
        "Python thread): Result.extras['thread_cpu_s_per_step'].")
    measure_every: int = option(
        10, "measure_every",
        "Count the bytes each route moves, and the plan's lower bound, in the first step and every this many "
        "steps after (1: every step; the counting ops cost a step CPU, 5% of one on recsys' 19 tables).")


@dataclasses.dataclass
class DeviceOptions:
    """GPUs."""
    gpus_per_rank: Optional[int] = option(
        None, "gpus_per_rank",
        "GPUs each rank computes on: 1 (the default where TensorFlow lists GPUs; rank r of a host uses its "
        "GPU r) or 0 (the CPU). README: ranks and GPUs.", kind="int")
    gpu_memory_fraction: Optional[float] = option(
        None, "gpu_memory_fraction",
        "Cap on the GPU memory each rank takes (default: as it needs).", kind="float")
    share_gpus: bool = option(
        False, "share_gpus",
        "Let more ranks than GPUs on a host share them (rank r on GPU r mod G, each with 1/k of its memory).")

    @property
    def device_request(self) -> devices.DeviceRequest:
        return devices.DeviceRequest(self.gpus_per_rank, self.gpu_memory_fraction, self.share_gpus)


@dataclasses.dataclass
class Options(DeviceOptions, ObservationOptions, CheckpointOptions, ProcessOptions, PlanningOptions,
              TrainingOptions, LaunchOptions):
    """Every option of a run: the core's, grouped by concern above, and the strategies'."""
    strategy: str = ""
    # strategy -> its options dataclass (parallax_tf.strategy), parsed from its flags
    strategy_options: dict = dataclasses.field(default_factory=dict)

    @property
    def options(self):
        """The chosen strategy's options."""
        return self.strategy_options[self.strategy]


CORE_OPTIONS = (LaunchOptions, TrainingOptions, PlanningOptions, ProcessOptions, CheckpointOptions,
                ObservationOptions, DeviceOptions)
for _group in CORE_OPTIONS:
    strategy_lib.define_flags(_group, module_name=__name__)


def define_strategy_flag() -> None:
    """--strategy, once the strategies are registered: rewriters calls this after registering them,
    and so does parallax_tf.api (whichever of the two a program imports first)."""
    if "strategy" not in FLAGS and strategy_lib.names():
        flags.DEFINE_enum("strategy", strategy_lib.names()[0], list(strategy_lib.names()),
                          "How variables are synchronised (README: choosing a strategy).")


# Where the cost model's cluster comes from when its flags are not given: an emulated cluster
# (tools/cluster.py) sets these for the ranks it starts.
ENVIRONMENT_DEFAULTS = {"link_bandwidth": "PARALLAX_LINK_BANDWIDTH", "link_delay": "PARALLAX_LINK_DELAY",
                        "host_cores": "PARALLAX_CORES"}


def parse_command_line(argv) -> list:
    """Parses `argv` into FLAGS and returns what is left (absl's contract for app.run's
    flags_parser). A misspelled or unknown flag, or a bad value, is a ConfigError: one line and
    status 2 on the command line. Arguments of a program that is not the user's own script (pytest,
    a notebook kernel) are not the job's flags: there only the flags absl knows are read.
    `--help` (`-h`, `--helpshort`) and `--helpfull` print the flags and end the program with
    status 0, with or without absl's app.run (whose own help flags end with status 1)."""
    argv = toolkit_argv(argv)
    if users_program():
        asked = help_asked(argv)
        if asked:
            print_help(full=asked == "full")
            raise SystemExit(0)
        app.define_help_flags()      # so that --nohelp, --help=false parse as under app.run
    try:
        return FLAGS(argv, known_only=not users_program())
    except flags.Error as err:
        raise ConfigError(f"{err}; `--helpfull` lists the flags (your own arguments go after `--`)") from None


def print_help(full: bool) -> None:
    """absl's usage text on stdout: the program's docstring, then its flags. Short: the
    program's own flags, parallax_tf's and the strategies'; full: every module's."""
    main = sys.modules.get("__main__")
    doc = getattr(main, "__doc__", None) or f"\nUSAGE: {sys.argv[0]} [flags]\n"
    if full:
        listed = FLAGS.get_help()
    else:
        ours = ["np", "strategy", *strategy_lib.option_flags()]
        modules = dict.fromkeys(FLAGS.find_module_defining_flag(name) for name in ours if name in FLAGS)
        listed = "\n".join([FLAGS.main_module_help()] + [FLAGS.module_help(m) for m in modules if m])
    text = doc.rstrip("\n") + "\n\nflags:" + listed + ("" if full else "\n\nTry --helpfull to get a list of all flags.")
    try:
        print(text, flush=True)
    except BrokenPipeError:         # `--helpfull | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def resolve(**overrides) -> Options:
    """Options from the flags, keyword arguments of run() overriding them (said once where a flag
    on the command line is overridden); every strategy's options parsed and checked once."""
    if not FLAGS.is_parsed():
        parse_command_line(sys.argv)
    names = [f.name for f in dataclasses.fields(Options) if f.name != "strategy_options"]
    strategy_flags = list(strategy_lib.option_flags())
    unknown = sorted(set(overrides) - set(names) - set(strategy_flags))
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown}; known: {', '.join(names + strategy_flags)}")
    _say_overridden({name: v for name, v in overrides.items() if v is not None})

    def value(name):
        return overrides[name] if overrides.get(name) is not None else getattr(FLAGS, name)
    values = {n: value(n) for n in names}
    for name, variable in ENVIRONMENT_DEFAULTS.items():
        if values[name] is None and os.environ.get(variable):
            values[name] = int(os.environ[variable]) if name == "host_cores" else os.environ[variable]
    options = Options(**values, strategy_options=strategy_lib.parse_options({f: value(f) for f in strategy_flags}))
    strategy_lib.get(options.strategy)
    if options.np is not None and options.np < 1:
        raise ConfigError(f"--np must be at least 1, got {options.np}")
    if options.host_slots and not options.np:
        raise ConfigError(f"--host_slots={options.host_slots} needs --np: the ranks to start on those hosts")
    if options.steps < 0:
        raise ConfigError(f"--steps must be >= 0, got {options.steps}")
    if options.partitions is not None and options.partitions < 1:
        raise ConfigError(f"--partitions must be >= 1, got {options.partitions}")
    if options.dynamic_tables not in (None, "servers", "replicated"):
        raise ConfigError(f"--dynamic_tables={options.dynamic_tables!r}: use servers or replicated (or leave it unset)")
    try:
        options.timeline_steps = [int(s) for s in options.timeline_steps]
    except ValueError:
        raise ConfigError(f"--timeline_steps takes step numbers, got {options.timeline_steps}") from None
    if options.ckpt_every < 0 or options.ckpt_secs < 0 or options.ckpt_keep < 1:
        raise ConfigError("--ckpt_every and --ckpt_secs must be >= 0 and --ckpt_keep >= 1")
    if options.commit_every < 0:
        raise ConfigError(f"--commit_every must be >= 0, got {options.commit_every}")
    if options.max_restarts is not None and (options.max_restarts < 0 or options.max_restarts and not options.ckpt_dir):
        raise ConfigError(f"--max_restarts={options.max_restarts}: give a count >= 0, and --ckpt_dir for the "
                          "checkpoints a restart resumes from")
    pool_threads.parse(options.threads)         # a clear error now, not once the cluster is up
    options.device_request.check()
    if options.timeout_s < 1:
        raise ConfigError(f"--timeout_s must be >= 1, got {options.timeout_s}")
    if options.measure_every < 1:
        raise ConfigError(f"--measure_every must be >= 1 (1: every step), got {options.measure_every}")
    return options


_SAID_OVERRIDES: set = set()


def given_on_command_line(name: str) -> bool:
    return name in FLAGS and bool(FLAGS[name].present)


def _say_overridden(overrides: dict) -> None:
    """One note (on rank 0, once per process) for each run() keyword that replaces a different
    value given for its flag on the command line."""
    if os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")) != "0":
        return
    for name, value in sorted(overrides.items()):
        given = FLAGS[name] if name in FLAGS else None
        if given is None or not given.present or given.value == value or name in _SAID_OVERRIDES:
            continue
        _SAID_OVERRIDES.add(name)
        print(f"parallax_tf: note: run({name}={value!r}) overrides --{name}={given.value!r} from the command line",
              file=sys.stderr, flush=True)
