"""The baselines, written the way users write them without parallax_tf, for tools.bench.

  horovod        hvd.DistributedOptimizer on the whole model (IndexedSlices by allgather)
  horovod_dense  the same with sparse_as_dense=True
  tf_ps          replica_device_setter (greedy by bytes) + SyncReplicasOptimizer
  single         one process, plain TF: the compute time a step needs with no communication
  tf_mwms        tf.distribute.MultiWorkerMirroredStrategy in TF2 (tools/baselines_mwms.py)
Each returns per-step wall times and examples per step, like parallax_tf.run's Result."""
from __future__ import annotations

import contextlib
import functools
import time

import tensorflow as tf
from absl import flags

from parallax_tf import flags as ptf_flags  # noqa: F401  (--threads)
from parallax_tf import threads as pool_threads
from parallax_tf.feeds import batch_size, make_feeds
from parallax_tf.graph_walk import needed_placeholders
from parallax_tf.inspect_graph import logical_name
from parallax_tf.model import RunContext
from parallax_tf.runtime.cluster import start_cluster
from parallax_tf.runtime import quiet
from parallax_tf.runtime.hooks import StepStats
from parallax_tf.training_graph import call_model_fn
from tools import link_counters

BASELINES = ("horovod", "horovod_dense", "tf_ps", "tf_mwms", "single")
STALE_RUNS_CAP = 4


def run(name: str, model_fn, input_fn, steps: int, seed: int = 0, profile_threads_from: int = -1) -> dict:
    """`profile_threads_from`: from this step on, CPU per thread name (thread_cpu_s_per_step)."""
    quiet.apply(flags.FLAGS.verbose)      # TF's notices as quiet as in parallax_tf's own runs
    # TF's pools sized as parallax_tf sizes its own (--threads), so the comparison is of the
    # strategies, not of thread counts
    if name == "single":
        process = pool_threads.ProcessConfig(pool_threads.choose(flags.FLAGS.threads, 1))
        return {**_single(model_fn, input_fn, steps, seed, process, profile_threads_from),
                "pool_threads": process.threads}
    if name == "tf_mwms":       # eager TF2 with its own servers: the model's TF2 form, from --model
        from tools import baselines_mwms
        return baselines_mwms.run(input_fn, steps, profile_threads_from)
    cluster = start_cluster(None, None, threads=flags.FLAGS.threads, host_job="ps" if name == "tf_ps" else None)
    topo = cluster.topology
    ctx = RunContext(topo.rank, topo.size, topo.local_rank, topo.local_size, 0)
    if name in ("horovod", "horovod_dense"):
        return {"pool_threads": cluster.process.threads,
                **_horovod(model_fn, input_fn, steps, seed, ctx, sparse_as_dense=name == "horovod_dense",
                           process=cluster.process, profile_from=profile_threads_from)}
    if name == "tf_ps":
        return {"pool_threads": cluster.process.threads,
                **_tf_ps(model_fn, input_fn, steps, seed, ctx, cluster, profile_threads_from)}
    raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(BASELINES)}")


def _loop(sess_run, graph, model, input_fn, ctx, steps, before_barrier=None, profile_from=-1):
    """Runs `steps` steps, or until `sess_run` returns False (it ran its last step)."""
    placeholders = needed_placeholders(model.loss)
    stats, examples = StepStats(profile_from), 0     # times, CPU per step and per thread as parallax_tf counts them
    link_before = link_counters.read() if ctx.local_rank == 0 else None
    for step in range(steps):
        ctx.step = step
        feeds = make_feeds(input_fn, ctx, placeholders, graph)
        begin = time.perf_counter()
        more = sess_run(feeds)
        examples = batch_size(feeds) * ctx.size
        stats.add(time.perf_counter() - begin, {}, examples)
        if more is False:
            break
    profile = stats.thread_cpu_per_step()
    link_after = link_counters.read() if link_before else None
    if before_barrier is not None:
        before_barrier()
    if ctx.size > 1:        # rank 0's process serves the PS: nobody leaves while others train
        import horovod.tensorflow as hvd
        hvd.allgather_object(None)
    return {"step_times": stats.times, "examples_per_step": examples, "step_cpu_s": stats.cpu_times,
            "thread_cpu_s_per_step": profile,
            "link_bytes": link_counters.difference(link_before, link_after)}


@contextlib.contextmanager
def _every_apply(wrap):
    """While model_fn builds its own train op, every tf.compat.v1.train optimizer's
    apply_gradients goes through `wrap(apply, optimizer, grads_and_vars, global_step, name)`:
    how a user makes a train op with several optimizers (wide & deep) distributed by hand."""
    cls = tf.compat.v1.train.Optimizer
    original = cls.apply_gradients
    inside = []

    def apply_gradients(optimizer, grads_and_vars, global_step=None, name=None):
        if inside:       # the wrapper's own apply (SyncReplicasOptimizer applies the model's)
            return original(optimizer, grads_and_vars, global_step, name)
        inside.append(optimizer)
        try:
            return wrap(functools.partial(original, optimizer), optimizer, list(grads_and_vars), global_step, name)
        finally:
            inside.pop()
    cls.apply_gradients = apply_gradients
    try:
        yield
    finally:
        cls.apply_gradients = original


def _initialise(sess) -> None:
    sess.run([tf.compat.v1.global_variables_initializer(), tf.compat.v1.local_variables_initializer(),
              tf.compat.v1.tables_initializer()])


def _single(model_fn, input_fn, steps, seed, process, profile_from):
    graph = tf.Graph()
    ctx = RunContext()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        model = call_model_fn(model_fn, ctx)
        train = model.train_op if model.train_op is not None else model.optimizer.minimize(model.loss)
        sess = tf.compat.v1.Session(graph=graph, config=process.proto())
        _initialise(sess)
    return _loop(lambda feeds: sess.run(train, feeds), graph, model, input_fn, ctx, steps,
                 profile_from=profile_from)


def _horovod(model_fn, input_fn, steps, seed, ctx, sparse_as_dense, process, profile_from):
    import horovod.tensorflow as hvd
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        def averaged(apply, optimizer, grads_and_vars, global_step, name):
            # what hvd.DistributedOptimizer does to each gradient (IndexedSlices by allgather)
            pairs = [(g if g is None else hvd.allreduce(tf.convert_to_tensor(g) if sparse_as_dense else g,
                                                         op=hvd.Average), v) for g, v in grads_and_vars]
            return apply(pairs, global_step, name)
        with _every_apply(averaged):
            model = call_model_fn(model_fn, ctx)
        if model.train_op is not None:
            train = model.train_op
        else:
            train = hvd.DistributedOptimizer(model.optimizer, sparse_as_dense=sparse_as_dense).minimize(model.loss)
        broadcast = hvd.broadcast_global_variables(0)
        sess = tf.compat.v1.Session(graph=graph, config=process.proto())
        _initialise(sess)
        sess.run(broadcast)
        trained = tf.compat.v1.global_variables()
    figures = _loop(lambda feeds: sess.run(train, feeds), graph, model, input_fn, ctx, steps,
                    profile_from=profile_from)
    if ctx.rank == 0:       # the trained values under single-device names, for the held-out loss
        figures["variables"] = {logical_name(v): value for v, value in zip(trained, sess.run(trained))}
    return figures


def _tf_ps(model_fn, input_fn, steps, seed, ctx, cluster, profile_from):
    import horovod.tensorflow as hvd
    num_ps = len(cluster.spec["ps"])
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        setter = tf.compat.v1.train.replica_device_setter(
            ps_tasks=num_ps, worker_device=f"/job:worker/task:{ctx.rank}", cluster=cluster.spec,
            ps_strategy=GreedyByBytes(num_ps))
        with tf.compat.v1.device(setter):   # TF2 tf.device takes no device functions
            applies = []

            def collected(apply, optimizer, grads_and_vars, global_step, name):
                applies.append((optimizer, grads_and_vars, global_step))
                return tf.no_op()
            with _every_apply(collected):
                model = call_model_fn(model_fn, ctx)
            global_step = tf.compat.v1.train.get_or_create_global_step()
            if model.train_op is None:
                optimizer = tf.compat.v1.train.SyncReplicasOptimizer(
                    model.optimizer, replicas_to_aggregate=ctx.size, total_num_replicas=ctx.size)
                train = optimizer.minimize(model.loss, global_step=global_step)
            else:
                # one SyncReplicasOptimizer aggregates every gradient of the step: one per optimizer
                # would each keep a token queue, and workers deadlock between them at the end
                optimizer = tf.compat.v1.train.SyncReplicasOptimizer(
                    _OneApply(applies), replicas_to_aggregate=ctx.size, total_num_replicas=ctx.size)
                train = optimizer.apply_gradients([pair for _, pairs, _ in applies for pair in pairs],
                                                  global_step=global_step)
        # as TF's own examples run it: every worker until the global step reaches `steps` (a
        # worker's own step count is not the aggregation count: tokens go to whoever asks first)
        hooks = [optimizer.make_session_run_hook(ctx.rank == 0), tf.compat.v1.train.StopAtStepHook(last_step=steps)]
    # SyncReplicasOptimizer can wait forever for a gradient that never comes; bound every wait
    config = cluster.process.proto(device_filters=["/job:ps", f"/job:worker/task:{ctx.rank}"],
                                 operation_timeout_in_ms=120_000)

    def open_session():
        with graph.as_default():
            return tf.compat.v1.train.MonitoredTrainingSession(master=cluster.target, is_chief=ctx.rank == 0,
                                                               hooks=hooks, config=config)
    # The chief initialises first; a worker that finds the model not ready polls only every 30 s.
    if ctx.rank == 0:
        sess = open_session()
        hvd.allgather_object(None)
    else:
        hvd.allgather_object(None)
        sess = open_session()

    def step(feeds):
        try:
            sess.run(train, feeds)
        except tf.errors.OutOfRangeError:
            # the chief reached the last step and closed its token queue while this worker
            # waited for a token: its gradient was not needed
            if ctx.rank == 0:
                raise
            return False
        return not sess.should_stop()
    # the chief closes first (which releases workers still waiting for a token), then all meet
    # A worker loops until the global step reaches `steps`, not `steps` times: a gradient the
    # aggregation drops as stale does not count, so a worker may need more runs than steps
    # (the cap only bounds a broken run).
    return _loop(step, graph, model, input_fn, ctx, STALE_RUNS_CAP * steps,
                 before_barrier=sess.close if ctx.rank == 0 else None, profile_from=profile_from)


class _OneApply(tf.compat.v1.train.Optimizer):
    """The applies of a train op with several optimizers (wide & deep: FTRL and Adagrad) as one
    optimizer, for one SyncReplicasOptimizer: each model optimizer applies to its variables, the
    one that advanced the global step advances it (the first, if none did)."""

    def __init__(self, applies):
        super().__init__(use_locking=False, name="OneApply")
        self.owners = [(optimizer, {v.op.name for _, v in pairs}, step is not None)
                       for optimizer, pairs, step in applies]
        if not any(advances for _, _, advances in self.owners):
            self.owners[0] = self.owners[0][:2] + (True,)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        grads_and_vars = list(grads_and_vars)     # SyncReplicasOptimizer hands a zip
        ops = []
        for optimizer, names, advances in self.owners:
            pairs = [(g, v) for g, v in grads_and_vars if v.op.name in names and g is not None]
            ops.append(optimizer.apply_gradients(pairs, global_step if advances else None))
        return tf.group(*ops)


class GreedyByBytes:
    """tf.contrib.training.GreedyLoadBalancingStrategy with byte_size_load_fn (contrib is gone
    from TF 2): each variable goes to the PS task holding the fewest bytes so far."""

    def __init__(self, num_tasks: int):
        self.loads = [0] * num_tasks

    def __call__(self, op) -> int:
        task = min(range(len(self.loads)), key=lambda t: (self.loads[t], t))
        shape = tf.TensorShape(op.get_attr("shape"))
        self.loads[task] += (shape.num_elements() or 0) * tf.as_dtype(op.get_attr("dtype")).size
        return task
