"""Every absl flag of parallax_tf, parsed in one place; keyword arguments of run() override."""
from __future__ import annotations

import dataclasses
import sys
from typing import Optional

from absl import flags

from parallax_tf.errors import ConfigError
from parallax_tf.planner import STRATEGIES
from parallax_tf.runtime import pool_threads

FLAGS = flags.FLAGS
flags.DEFINE_enum("strategy", "hybrid", list(STRATEGIES), "How variables are synchronised.")
flags.DEFINE_integer("np", None, "Ranks to launch locally when not under horovodrun/mpirun.")
flags.DEFINE_integer("steps", 100, "Training steps.")
flags.DEFINE_integer("log_every", 10, "Progress line every this many steps (rank 0); 0 turns it off.")
flags.DEFINE_bool("plan_only", False, "Print the plan and return without training.")
flags.DEFINE_integer("partitions", None, "Shards for every sparse PS variable (default: the count with the "
                     "shortest step the cost model predicts).")
flags.DEFINE_string("calibration", None, "The cost model's machine constants, written by python -m tools.calibrate "
                    "(default: $PARALLAX_CALIBRATION, else ~/.cache/parallax_tf/calibration.json; built-in "
                    "defaults when there is no file).")
flags.DEFINE_bool("local_aggregation", True, "Sum sparse gradients of a host's ranks before sending.")
flags.DEFINE_integer("port", None, "First port to try for the TF servers (default: any free port).")
flags.DEFINE_string("bind_address", None, "Address the TF servers bind to (default: loopback when "
                    "all ranks are on one host, else the host's address).")
flags.DEFINE_integer("timeout_s", 120, "Longest any cross-rank wait may take before the run fails.")
flags.DEFINE_integer("seed", 0, "Graph-level random seed, the same on every rank.")
flags.DEFINE_string("ckpt_dir", None, "Write checkpoints here and resume from the latest one.")
flags.DEFINE_integer("ckpt_every", 0, "Checkpoint every this many steps (0: only by time/at the end).")
flags.DEFINE_float("ckpt_secs", 0, "Checkpoint at most this many seconds apart (0: off).")
flags.DEFINE_integer("ckpt_keep", 3, "Checkpoints kept; older ones are deleted.")
flags.DEFINE_string("logdir", None, "TensorBoard event files (loss, throughput, bytes per route).")
# Not `--timeline`: horovodrun's argparse takes any prefix of its own --timeline-filename from
# the script's arguments too, so that name cannot reach the ranks.
flags.DEFINE_string("timeline_file", None, "Chrome trace of the --timeline_steps steps (PATH) plus "
                    "Horovod's timeline (PATH.horovod.json).")
flags.DEFINE_list("timeline_steps", ["3", "4"], "Steps (0-based) traced by --timeline_file.")
flags.DEFINE_string("link_bandwidth", None, "Per-host link rate --strategy=auto plans for (e.g. 10gbit; "
                    "default: what tools.cluster emulates, else 10gbit).")
flags.DEFINE_integer("profile_threads_from", -1, "From this step on, count this process's CPU per thread name "
                     "(TF's pools, gRPC's, Horovod's, the Python thread): Result.extras['thread_cpu_s_per_step'].")
flags.DEFINE_string("threads", "auto", "Threads in each of TensorFlow's pools (inter- and intra-op) per rank: auto "
                    "(the cores its cgroup quota or CPU affinity allows, shared by the ranks of its host), tf "
                    "(TensorFlow's own sizing: every core of the machine), or a number.")
flags.DEFINE_bool("verbose", False, "Show TensorFlow's and Horovod's own logs and each rank's server addresses.")
flags.DEFINE_string("link_delay", None, "One-way per-link delay --strategy=auto plans for (default: "
                    "what tools.cluster emulates, else 0.05ms).")
flags.DEFINE_float("slim_core", 0.1, "slim_dp: fraction of each dense variable in the core (significant) set.")
flags.DEFINE_float("slim_explore", 0.08, "slim_dp: fraction of each dense variable explored per round.")
flags.DEFINE_integer("slim_refresh", 10, "slim_dp: rounds between core-set refreshes.")
flags.DEFINE_integer("slim_period", 1, "slim_dp: local steps per communication round.")
flags.DEFINE_float("slim_lambda", 1.0, "slim_dp: weight of the last aggregated update in the significance score.")
flags.DEFINE_bool("slim_error_feedback", True, "slim_dp: keep the unsent part of a rank's accumulated "
                  "gradient and add it to the next round's (--noslim_error_feedback: drop it).")
flags.DEFINE_string("staleness_lr", "inverse", "ps_plus: learning rate of a push computed on a copy tau versions "
                    "old: inverse (lr / max(1, tau)), none (plain async), exp:GAMMA (lr * GAMMA**tau).")
flags.DEFINE_enum("ps_plus_sparse_pull", "rows", ["rows", "eager"], "ps_plus: a sparse variable's rows are read "
                  "from its server in the step (rows), or the whole variable is pulled into a local copy like a "
                  "dense one (eager).")
flags.DEFINE_bool("auto_stanza", False, "auto may choose stanza when the cost model predicts it faster; its FC "
                  "nodes read no data, so a step then trains on fewer batches (one per conv node).")
flags.DEFINE_integer("fc_nodes", 1, "stanza: how many of the last ranks train the FC head (FC nodes).")
flags.DEFINE_integer("stanza_microbatches", 1, "stanza: each conv node's batch crosses to its FC node in this many "
                     "pieces, so FC round trips overlap conv work.")
flags.DEFINE_enum("stanza_sends", "auto", ["auto", "together", "staggered"], "stanza: a group's conv nodes send "
                  "their activations to its FC node (and get their gradients back) all at once, or one after "
                  "another; auto: staggered where together they would overflow the FC node's port (TCP incast).")
flags.DEFINE_integer("stages", None, "dsp: pipeline stages K (default: every rank, one pipeline).")
flags.DEFINE_integer("dsp_replicas", 1, "dsp: pipelines side by side R (ranks = K x R), data parallel across them.")
flags.DEFINE_list("dsp_cuts", [], "dsp: the K-1 tensors where stages 1..K-1 begin (default: the planner balances "
                  "the measured compute).")
flags.DEFINE_enum("dsp_schedule", "dsp", ["dsp", "locked"], "dsp: the tick rule with layer-wise staleness; "
                  "locked: one batch in the pipeline at a time, plain backprop (the baseline DSP removes).")
flags.DEFINE_float("dsp_grad_scale", 1.0, "dsp: factor on the gradient of every stage but the last (stale ones).")
flags.DEFINE_integer("max_staleness", 16, "ps_plus: a rank whose copy is more than this many versions behind the "
                     "global one waits for a fresh pull before its next step (bounded staleness).")


@dataclasses.dataclass
class Options:
    strategy: str
    np: Optional[int]
    steps: int
    log_every: int
    plan_only: bool
    partitions: Optional[int]
    calibration: Optional[str]
    profile_threads_from: int
    local_aggregation: bool
    port: Optional[int]
    bind_address: Optional[str]
    timeout_s: int
    seed: int
    ckpt_dir: Optional[str]
    ckpt_every: int
    ckpt_secs: float
    ckpt_keep: int
    logdir: Optional[str]
    timeline_file: Optional[str]
    timeline_steps: list
    link_bandwidth: Optional[str]
    link_delay: Optional[str]
    threads: str
    verbose: bool
    slim_core: float
    slim_explore: float
    slim_refresh: int
    slim_period: int
    slim_lambda: float
    slim_error_feedback: bool
    staleness_lr: str
    max_staleness: int
    ps_plus_sparse_pull: str
    auto_stanza: bool
    fc_nodes: int
    stanza_microbatches: int
    stanza_sends: str
    stages: Optional[int]
    dsp_replicas: int
    dsp_cuts: list
    dsp_grad_scale: float
    dsp_schedule: str

    def route_options(self) -> dict:
        """Options the plan stores in the params of the variables on a route."""
        from parallax_tf.plan import ROUTE_ASYNC_PS, ROUTE_FC_NODE, ROUTE_SIGNIFICANT, ROUTE_STAGE
        return {ROUTE_SIGNIFICANT: self.slim(), ROUTE_ASYNC_PS: self.ps_plus(),
                ROUTE_STAGE: {"stages": self.stages, "replicas": self.dsp_replicas, "cuts": list(self.dsp_cuts),
                              "grad_scale": self.dsp_grad_scale, "schedule": self.dsp_schedule},
                ROUTE_FC_NODE: {"fc_nodes": self.fc_nodes, "microbatches": self.stanza_microbatches,
                                "sends": self.stanza_sends}}

    def ps_plus(self) -> dict:
        rule, gamma = parse_staleness_lr(self.staleness_lr)
        return {"rule": rule, "gamma": gamma, "max_staleness": self.max_staleness,
                "sparse_pull": self.ps_plus_sparse_pull}

    def slim(self) -> dict:
        """The Slim-DP options as the plan stores them."""
        return {"core": self.slim_core, "explore": self.slim_explore, "refresh": self.slim_refresh,
                "period": self.slim_period, "lambda": self.slim_lambda, "error_feedback": self.slim_error_feedback}


def resolve(**overrides) -> Options:
    if not FLAGS.is_parsed():
        FLAGS(sys.argv, known_only=True)
    names = [f.name for f in dataclasses.fields(Options)]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown}; known: {', '.join(names)}")
    values = {n: overrides[n] if overrides.get(n) is not None else getattr(FLAGS, n) for n in names}
    options = Options(**values)
    if options.strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {options.strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if options.np is not None and options.np < 1:
        raise ConfigError(f"--np must be at least 1, got {options.np}")
    if options.steps < 0:
        raise ConfigError(f"--steps must be >= 0, got {options.steps}")
    if options.partitions is not None and options.partitions < 1:
        raise ConfigError(f"--partitions must be >= 1, got {options.partitions}")
    try:
        options.timeline_steps = [int(s) for s in options.timeline_steps]
    except ValueError:
        raise ConfigError(f"--timeline_steps takes step numbers, got {options.timeline_steps}") from None
    if options.ckpt_every < 0 or options.ckpt_secs < 0 or options.ckpt_keep < 1:
        raise ConfigError("--ckpt_every and --ckpt_secs must be >= 0 and --ckpt_keep >= 1")
    pool_threads.parse(options.threads)         # a clear error now, not once the cluster is up
    if options.timeout_s < 1:
        raise ConfigError(f"--timeout_s must be >= 1, got {options.timeout_s}")
    if not (0.0 <= options.slim_core <= 1.0 and 0.0 <= options.slim_explore <= 1.0
            and options.slim_core + options.slim_explore <= 1.0):
        raise ConfigError(f"--slim_core ({options.slim_core}) and --slim_explore ({options.slim_explore}) are "
                          "fractions of each variable: each in [0, 1], and together at most 1")
    if options.slim_period < 1 or options.slim_refresh < 1 or options.slim_lambda < 0:
        raise ConfigError("--slim_period and --slim_refresh must be >= 1 and --slim_lambda >= 0")
    parse_staleness_lr(options.staleness_lr)
    if options.stages is not None and options.stages < 1:
        raise ConfigError(f"--stages must be >= 1, got {options.stages}")
    if options.dsp_grad_scale <= 0:
        raise ConfigError(f"--dsp_grad_scale must be > 0, got {options.dsp_grad_scale}")
    if options.max_staleness < 0:
        raise ConfigError(f"--max_staleness must be >= 0 (0: every step waits for the newest values), "
                          f"got {options.max_staleness}")
    return options


def parse_staleness_lr(text: str):
    """(rule, gamma) of --staleness_lr: inverse | none | exp:GAMMA with 0 < GAMMA <= 1."""
    if text in ("inverse", "none"):
        return text, 1.0
    if text.startswith("exp:"):
        try:
            gamma = float(text[4:])
        except ValueError:
            gamma = -1.0
        if 0.0 < gamma <= 1.0:
            return "exp", gamma
    raise ConfigError(f"--staleness_lr={text!r}: use inverse (lr / max(1, tau)), none (plain async) or "
                      "exp:GAMMA with 0 < GAMMA <= 1 (lr * GAMMA**tau), e.g. exp:0.9")
