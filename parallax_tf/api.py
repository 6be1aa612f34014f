"""parallax_tf.run: inspect -> plan -> rewrite -> run."""
from __future__ import annotations

import functools
import itertools
import os
import sys
import time
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

import rewriters  # noqa: F401  (registers the techniques: the core reaches them only through parallax_tf.strategy)
from parallax_tf import flags as ptf_flags
from parallax_tf import devices, dynamic, front_end as front_end_lib, model_init, rank_run, strategy as strategy_lib, tf2
from parallax_tf.dynamic.state import DynamicState
from parallax_tf.checkpoint import CheckpointStore
from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.errors import ConfigError
from parallax_tf.inspect_graph import capture
from parallax_tf.model import Result, RunContext
from parallax_tf.plan import Plan, ROUTE_LOCAL, human_bytes
from parallax_tf.planner import PlanRequest, make_plan, measurements
from parallax_tf.runtime import cluster as cluster_lib
from parallax_tf.runtime import exit as exit_lib, launch, launcher, placement, quiet, rank_objects, session, teardown
from parallax_tf.runtime.hooks import (Checkpointer, Hook, LiveRun, Progress, StepTracer, Summaries,
                                      format_histogram, tables_line)
from parallax_tf.runtime.runner import RunInputs, SyncRunner
from parallax_tf.runtime.watchdog import Watchdog, launcher_address
from parallax_tf.values import StateIO, collect_state

_RUN_IDS = itertools.count()
ptf_flags.define_strategy_flag()


def run(model_fn: Callable, input_fn=None, steps: Optional[int] = None,
        hooks: Sequence[Hook] = (), **options) -> Result:
    """Trains a single-device model on every rank of the job and returns the result: a
    tf.compat.v1 model_fn's graph, fed by input_fn(ctx) (or its own tf.data pipeline), or, given
    a tf.data.Dataset in input_fn's place, a TF2 training step (a tf.function or a Python
    function taking one of the dataset's elements) trained on each of its elements, one a step
    (steps: one pass over the dataset unless said), after which the step's own variables hold
    the trained values.

    Options are the absl flags of parallax_tf.flags and of each strategy (strategy, np,
    partitions, slim_core, ...); keyword arguments override the flags. `hooks`
    (runtime.hooks.Hook) run on every rank around and between steps. Outside any launcher with
    np > 1 this process launches the ranks, waits for them and exits with their status."""
    # A TF1 script's first line, tf.compat.v1.disable_eager_execution(), makes graph mode the
    # process's default; model_fn builds its graphs either way, and the toolkit's own eager work
    # (Horovod's object exchanges, checkpoint writes) runs as it does in every other script.
    with tf_shim.eager_mode():
        if not tf2.is_dataset(input_fn):
            return _run(front_end_lib.ModelFn(model_fn), input_fn, steps, hooks, options)
        step = tf2.StepFrontEnd(model_fn, input_fn)
        result = _run(step, None, steps, hooks, options)
        if result.variables:
            step.write_back(result)
        return result


def _run(front_end, input_fn, steps, hooks, options) -> Result:
    phases = {"run": time.time()}        # when each start-up phase ended (Result.extras["phases"])
    exit_lib.ran()
    opts = ptf_flags.resolve(steps=steps, **options)
    if front_end.traced:           # a TF2 step: its dataset feeds it, one pass unless said
        input_fn = front_end.input_fn(opts.shard_reading)
        if steps is None and not ptf_flags.given_on_command_line("steps"):
            opts.steps = front_end.steps(None, opts.shard_reading)
    quiet.apply(opts.verbose)
    if opts.plan_only:
        result = _plan_only(front_end, input_fn, opts)
        if options.get("plan_only") is None:     # asked for on the command line: the program ends here
            sys.exit(0)
        return result
    if not cluster_lib.under_launcher() and (opts.np or 1) > 1:
        sys.exit(launch.launch_local(opts.np, opts.verbose, launch.restarts_of(opts.max_restarts, opts.ckpt_dir),
                                     opts.ckpt_dir, opts.min_np, opts.host_discovery_script,
                                     opts.host_slots, opts.ssh_port, opts.ssh_identity_file))
    if opts.commit_every and not os.environ.get(launcher.COMMIT_DIR_ENV):
        raise ConfigError(f"--commit_every={opts.commit_every}: in-memory commits need parallax_tf's launcher "
                          "(--np N, or tools.cluster) with rank 0 on the launching machine, which keeps them "
                          "across restarts")
    _bound_horovod_stalls(opts.timeout_s)
    if opts.timeline_file:   # read by hvd.init(): Horovod's own timeline beside the TF step trace
        os.environ.setdefault("HOROVOD_TIMELINE", opts.timeline_file + ".horovod.json")
    cluster = cluster_lib.start_cluster(opts.bind_address, opts.port, opts.verbose, opts.threads,
                                        device_request=opts.device_request)
    phases["rendezvous"] = time.time()
    topo = cluster.topology
    if opts.np is not None and opts.np != topo.size and cluster_lib.under_launcher():
        raise ConfigError(f"--np={opts.np} but the launcher started {topo.size} ranks; "
                          "drop --np under horovodrun/mpirun")
    ctx = RunContext(topo.rank, topo.size, topo.local_rank, topo.local_size, 0,
                     batch_joined=strategy_lib.get(opts.strategy).batch_joined)
    captured = capture(front_end, input_fn, ctx, opts.seed, evaluate=topo.is_chief, shard_input=opts.shard_input,
                       process=cluster.process, **measurements(opts.strategy))
    phases["inspection"] = time.time()
    plan = _agree_on_plan(captured, opts, topo, cluster)
    phases["plan"] = time.time()
    if topo.is_chief and opts.log_every:
        print(plan.table(), flush=True)
    return _train(front_end, input_fn, opts, cluster, ctx, captured, plan, list(hooks), phases)


def _train(front_end, input_fn, opts, cluster, ctx, captured, plan, user_hooks, phases) -> Result:
    topo = cluster.topology
    run_id = f"parallaxrun{rank_objects.broadcast(next(_RUN_IDS))}"
    built = _build_rank_graph(front_end, opts, ctx, plan, topo, run_id)
    phases["graph"] = time.time()
    ran = _open_rank_session(opts, cluster, captured, plan, built, user_hooks,
                             whole_state=getattr(front_end, "writes_back", False))
    peer_lost = False
    try:
        trained = _train_steps(input_fn, opts, topo, ctx, captured, built, ran, phases)
    except session.PeerLost:
        peer_lost = True
        raise
    finally:
        # After a lost peer, closing the session could wait on it: leave it, and keep the
        # watchdog armed so this process still stops if anything on the way out hangs.
        if not peer_lost:
            _close_rank_session(opts, cluster, run_id, built, ran)
    phases["results"] = time.time()
    result = rank_run.result(plan, topo, phases, built, ran, trained)
    result.extras["pool_threads"] = cluster.process.threads      # TF's pools per rank (0: TF's own sizing)
    if topo.is_chief and opts.log_every:
        _print_summary(result, topo.size, trained.stats.loss_scope, _written(opts))
    return result


def _build_rank_graph(front_end, opts, ctx, plan, topo, run_id) -> rank_run.RankGraph:
    """The strategy's rewrite of the model into this rank's graph, initialised as the single-device
    script would, placed and finalized."""
    graph = tf.Graph()
    # Every op without an explicit placement runs on this rank's worker: left unplaced, TF's
    # placer may put it on a PS task, i.e. into another rank's process (Horovod ops included).
    with graph.as_default(), graph.container(run_id), tf.device(topo.worker_device):
        request = strategy_lib.BuildRequest(front_end, ctx, plan, topo, opts.seed, opts.shard_input)
        dgraph = strategy_lib.get(plan.strategy).rewrite(request)    # a rule may have chosen another strategy
        by_name = plan.by_name()
        for name, layout in dgraph.layouts.items():       # how the lookups read the shards it made
            if name in by_name:                           # (optimizer slots follow their variable)
                by_name[name].layout = layout
        # tables and iterators, as the single-device script initialises them
        dgraph.local_init = tf.group(dgraph.local_init, *model_init.initializers(graph, dgraph.train_op))
        input_reads = model_init.input_reads(graph, dgraph.train_op)
        batch_rows = model_init.batch_rows(input_reads)
        layouts = {**{k: (layout, None) for k, layout in dgraph.layouts.items()},
                   **{v.name: (v.layout, v.shape) for v in plan.variables}}
        entries = collect_state(dgraph, layouts)
        state_io = StateIO(entries, averaged=[v.name for v in plan.on_route(ROUTE_LOCAL) if v.params.get("combine") == "mean"],
                           num_ranks=topo.size, owners=_owners(plan, entries), rank=topo.rank,
                           dynamic=DynamicState(dynamic.tables(graph)) if dynamic.tables(graph) else None,
                           read_everywhere=getattr(front_end, "writes_back", False))
    placement.settle(graph, topo.server_ranks, topo.device_type)
    graph.finalize()
    on_cpu_instead = _ops_without_gpu_kernel(graph, topo, opts.verbose)
    return rank_run.RankGraph(graph, dgraph, state_io, input_reads, batch_rows, on_cpu_instead)


def _open_rank_session(opts, cluster, captured, plan, built, user_hooks, whole_state: bool = False) -> rank_run.RankSession:
    """The checkpoint stores and rank 0's starting values, the session, the hooks and the
    watchdog with the guard that turns a lost peer into one error."""
    topo = cluster.topology
    store = CheckpointStore(opts.ckpt_dir, opts.ckpt_keep) if opts.ckpt_dir else None
    commits = CheckpointStore(os.environ[launcher.COMMIT_DIR_ENV], 1) if opts.commit_every else None
    start_values = _start_values([store, commits], captured, built.state_io) if topo.is_chief else {}
    remote = session.remote_tasks(built.graph, topo.rank)
    sess = session.open_session(cluster.target, built.graph, topo.rank, opts.timeout_s, remote,
                                in_process=session.alone(remote, topo.rank, topo.size), process=cluster.process)
    hooks, checkpointer, committer = _hooks(opts, topo, store, commits, built.state_io, sess, plan.global_step_key)
    hooks += user_hooks
    results = list(built.dgraph.parts) + [v.name for v in plan.on_route(ROUTE_LOCAL)] + \
        [k for k in built.state_io.keys if k not in built.state_io.entries]
    if whole_state:        # the front end writes everything back into the script's objects (slots too)
        results += [k for k in built.state_io.keys if k not in results]
    tracer = StepTracer(opts.timeline_file if topo.is_chief else None, opts.timeline_steps)
    watchdog = _watchdog(topo, cluster, built.dgraph) if topo.size > 1 else None
    alive = watchdog.alive if watchdog else (lambda: {topo.rank})
    guard = functools.partial(session.cross_rank_errors, timeout_s=opts.timeout_s, rank=topo.rank,
                              lost=watchdog.lost if watchdog else None,
                              deadline=watchdog.deadline if watchdog else None)
    return rank_run.RankSession(sess, store, commits, start_values, hooks, checkpointer, committer, results, tracer,
                        watchdog, alive, guard)


def _train_steps(input_fn, opts, topo, ctx, captured, built, ran, phases) -> rank_run.Trained:
    """Initialises the state, runs the steps with the hooks around them and reads the results
    back between the barriers every rank passes."""
    sess, dgraph, state_io, hooks = ran.sess, built.dgraph, built.state_io, ran.hooks
    start = session.initialise(sess, dgraph, state_io, ran.start_values, topo.is_chief, ran.guard, built.input_reads)
    phases["session"] = time.time()
    if topo.is_chief and start:
        print(f"resumed from {_newest([ran.store, ran.commits])} at step {start}", flush=True)
    live = LiveRun(topo.rank, topo.size, lambda: state_io.read(sess), state_io.collective,
                   isinstance(dgraph.runner, SyncRunner))
    for hook in hooks:
        hook.attach(live)
        hook.begin(start)
    began, cpu_began = time.perf_counter(), time.process_time()
    inputs = RunInputs(input_fn, ctx, captured.placeholders, start, opts.steps, hooks, ran.tracer, ran.guard,
                       opts.timeout_s * 1000, built.batch_rows, opts.profile_threads_from, opts.measure_every)
    losses, stats = dgraph.runner.run(sess, inputs)
    wall, cpu = time.perf_counter() - began, time.process_time() - cpu_began
    phases["training"] = time.time()
    threads = stats.thread_cpu_per_step()   # before the barrier and the variables' read-back
    with ran.guard("collecting results"):
        dgraph.barrier.wait(sess, "trained", ran.alive, opts.timeout_s)
        variables = state_io.read(sess, keys=ran.results, everywhere=state_io.shares_reads)
        global_step = int(sess.run(dgraph.global_step))
        report = dgraph.runner.final_report(sess)
        histograms = report.get("histograms", {})
        stats.extras.update(report.get("extras", {}))
        if threads:
            stats.extras["thread_cpu_s_per_step"] = threads
        for hook in hooks:
            hook.final(global_step, histograms)
        if ran.watchdog:            # peers may leave once the barrier below lets them
            ran.watchdog.stop()
        dgraph.barrier.wait(sess, "read", ran.alive, opts.timeout_s)   # nobody stops its servers while others read
        ran.read = True
    return rank_run.Trained(start, losses, stats, wall, cpu, variables, global_step, histograms)


def _close_rank_session(opts, cluster, run_id, built, ran) -> None:
    """Stops the watchdog, bounds the exit and closes the session, resetting the servers when
    every rank may."""
    topo = cluster.topology
    if ran.watchdog:
        ran.watchdog.stop()
    teardown.bound_exit(topo.rank, opts.timeout_s)
    # The reset reaches every rank's server, so only when all have read (the last point
    # where the ranks agree) and none is gone: it would wait for a gone server forever.
    teardown.finish(ran.sess, cluster.target, run_id, topo.rank, topo.size, opts.timeout_s,
                    reset=ran.read and built.dgraph.barrier.may_reset(topo.rank) and ran.alive() == set(range(topo.size)))


def _written(opts) -> str:
    """Where rank 0 wrote TensorBoard events and traces, for the summary."""
    said = []
    if opts.logdir:
        said.append(f"TensorBoard events in {opts.logdir} (view: tensorboard --logdir {opts.logdir})")
    if opts.timeline_file:
        said.append(f"Chrome trace of steps {','.join(map(str, opts.timeline_steps))} in {opts.timeline_file}, "
                    f"Horovod's timeline in {os.environ.get('HOROVOD_TIMELINE', opts.timeline_file + '.horovod.json')}")
    return "; ".join(said)


def _ops_without_gpu_kernel(graph, topo, verbose: bool) -> Optional[dict]:
    """On GPU ranks, the op types placed on the GPU that soft placement runs on the CPU (no GPU
    kernel for their attributes), by count; said on rank 0 with --verbose."""
    if topo.device_type != "GPU":
        return None
    found = devices.without_gpu_kernel(graph.get_operations(), devices.gpu_kernel_lookup())
    if verbose and topo.is_chief:
        listed = ", ".join(f"{op_type} x{count}" for op_type, count in found.items()) or "none"
        print(f"ops without a GPU kernel, run on the CPU instead: {listed}", flush=True)
    return found


def _watchdog(topo, cluster, dgraph) -> Watchdog:
    """Watches the other ranks. A job whose graph survives the loss of a rank that holds no
    server state tells the launcher (parallax_tf's own) which ranks those are, so that it does
    not stop the others when one of them exits."""
    expendable = set(range(topo.size)) - set(topo.server_ranks) if dgraph.survivable_loss else set()
    if topo.is_chief and expendable:
        launcher.write_expendable(expendable, dgraph.survivable_loss)
    return Watchdog(topo.rank, dict(enumerate(cluster.spec["worker"])), expendable=expendable,
                    launcher=launcher_address()).start()


def _owners(plan, keys) -> dict:
    """Checkpoint key -> the ranks that keep it, for variables the plan gives to some ranks only
    (and their optimizer slots, keyed "<variable>/<slot>")."""
    kept = {v.name: v.params["ranks"] for v in plan.variables if "ranks" in v.params}
    owners = {}
    for key in keys:
        name = max((n for n in kept if key == n or key.startswith(n + "/")), key=len, default=None)
        if name is not None:
            owners[key] = kept[name]
    return owners


def _newest(stores) -> Optional[str]:
    """The newest checkpoint of several stores (a disk checkpoint, an in-memory commit), by step."""
    return CheckpointStore.newest(stores)


def _start_values(stores, captured, state_io):
    """Rank 0's starting point: the newest checkpoint or commit if there is one, else
    single-device init."""
    path = _newest(stores)
    if path is None:
        return captured.initial_values
    values, _ = CheckpointStore.load(path)
    missing = sorted(set(state_io.keys) - set(values))
    if missing:
        raise ConfigError(f"checkpoint {path} lacks {missing}; it was written for another model or "
                          "optimizer. Point --ckpt_dir at an empty directory to start afresh")
    return {key: values[key] for key in state_io.keys}


def _hooks(opts, topo, store, commits, state_io, sess, step_key):
    """Rank 0 watches and writes; every rank takes part in checkpoints and commits when reading
    the state is collective (state averaged over ranks)."""
    hooks, checkpointer, committer = [], None, None
    if store is not None and (topo.is_chief or state_io.collective):
        checkpointer = Checkpointer(store if topo.is_chief else None, lambda: state_io.read(sess),
                                    opts.ckpt_every, opts.ckpt_secs, step_key=step_key)
        hooks.append(checkpointer)
    if commits is not None and (topo.is_chief or state_io.collective):
        committer = Checkpointer(commits if topo.is_chief else None, lambda: state_io.read(sess),
                                 opts.commit_every, 0, at_end=False, step_key=step_key)
        hooks.append(committer)
    if not topo.is_chief:
        return hooks, checkpointer, committer
    if opts.log_every:
        hooks.append(Progress(opts.steps, opts.log_every, topo.size))
    if opts.logdir:
        hooks.append(Summaries(opts.logdir))
    return hooks, checkpointer, committer


def _agree_on_plan(captured, opts, topo, cluster) -> Plan:
    text = None
    if topo.is_chief:
        plan = make_plan(PlanRequest(captured, opts.strategy, topo.size, len(topo.ranks_per_host), opts.partitions,
                         opts.local_aggregation, cost_cluster(opts, len(topo.ranks_per_host), max(topo.ranks_per_host)),
                         opts.options, opts.strategy_options, opts.dynamic_tables, opts.steps))
        plan.servers = list(cluster.server_addresses)
        plan.devices = cluster.devices
        text = plan.to_json()
    return Plan.from_json(rank_objects.broadcast(text))


def _plan_only(front_end, input_fn, opts) -> Result:
    ranks = opts.np or int(os.environ.get("HOROVOD_SIZE", "1"))
    ctx = RunContext(0, ranks, 0, ranks, 0)
    captured = capture(front_end, input_fn, ctx, opts.seed, shard_input=opts.shard_input, **measurements(opts.strategy))
    plan = make_plan(PlanRequest(captured, opts.strategy, ranks, 1, opts.partitions, opts.local_aggregation,
                     cost_cluster(opts, 1, ranks), opts.options, opts.strategy_options, opts.dynamic_tables,
                     opts.steps))
    listed = devices.listed_gpus()
    if listed and opts.gpus_per_rank != 0:     # what the ranks of one host would compute on
        import horovod.tensorflow as hvd
        choice = devices.choose(0, ranks, listed, opts.device_request)
        plan.devices = devices.summary(choice, bool(hvd.nccl_built()), bool(hvd.cuda_built()))
    print(plan.table())
    print("\nwhy:\n" + plan.reasons(), flush=True)
    return Result(variables={}, losses=[], plan=plan, plan_only=True)


def cost_cluster(opts, hosts: int, ranks_per_host: int):
    """The cluster the cost model plans for (routes where a strategy asks it, every PS variable's shard
    count): --link_bandwidth, --link_delay, --host_cores (flags.ENVIRONMENT_DEFAULTS); constants
    from the calibration file."""
    from parallax_tf import calibration, costmodel
    try:
        return costmodel.Cluster.calibrated(
            hosts, ranks_per_host, costmodel.parse_rate(opts.link_bandwidth or "10gbit"),
            costmodel.parse_delay(opts.link_delay or "0.05ms"), cores=opts.host_cores,
            calibration=calibration.load(opts.calibration), memory_bytes=_host_memory())
    except ValueError as err:
        raise ConfigError(f"--link_bandwidth/--link_delay: {err}") from None


def _host_memory() -> Optional[float]:
    """This host's memory in bytes (the cost model takes every host to have as much), if known."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _bound_horovod_stalls(timeout_s: int) -> None:
    # Horovod waits forever for a rank that never submits; make it give up like every other wait.
    os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(max(5, timeout_s // 4)))
    os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(timeout_s))


def _print_summary(result: Result, ranks: int, loss_scope: str, written: str) -> None:
    """The `done:` line: every figure as the progress line and the plan define it (the loss and
    metrics of the last step, mean over ranks; bytes per step and rank)."""
    if result.cluster_bytes_per_step:
        routes = {r: b / ranks for r, b in result.cluster_bytes_per_step.items()}
        whose = f"mean over {ranks} ranks" if ranks > 1 else "1 rank"
    else:
        routes, whose = result.bytes_per_step, "this rank"
    moved = ", ".join(f"{r} {human_bytes(b)}" for r, b in sorted(routes.items()) if b)
    rate = f"{result.examples_per_s:,.0f} examples/s" if result.examples_per_s else "examples/s n/a"
    steps = result.global_step - result.start_step
    losses = result.mean_losses or result.losses
    metrics = "".join(f", {name} {values[-1]:.4f}" for name, values in sorted(result.metrics.items())
                      if values and np.ndim(values[-1]) == 0)
    print(f"done: {steps} steps (global step {result.global_step}) in {result.wall_time_s:.1f}s, {rate}, "
          f"final loss ({loss_scope}) {losses[-1] if losses else float('nan'):.4f}{metrics}; bytes/step/rank "
          f"({whose}): {moved or 'none'}; checkpoint: {result.checkpoint or 'none'}"
          + (";" + tables_line({name: [t["rows"], t["admitted"], t["evicted"]]
                                for name, t in result.extras["dynamic_tables"].items()})
             if result.extras.get("dynamic_tables") else "")
          + (f"; went on without rank(s) {result.lost_ranks}" if result.lost_ranks else "")
          + (f"; wrote {written}" if written else ""), flush=True)
    for name, by_rank in sorted(result.histograms.items()):
        for rank, counts in sorted(by_rank.items()):
            print(f"{name} rank {rank}: {format_histogram(counts)}", flush=True)
