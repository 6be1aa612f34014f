"""tf_mwms: tf.distribute.MultiWorkerMirroredStrategy as a TF2 user writes it, for tools.bench.

Each rank is one MWMS worker with one replica (its CPU). The ranks learn each other's host:port
through one Horovod allgather (as runtime/cluster.py does) and build TF_CONFIG from it; MWMS
then starts its own gRPC server and runs TF's collective ops over it
(`CommunicationImplementation.RING`). The step is TF2's custom training loop: a `tf.function`
calling `strategy.run`, a per-example loss scaled by the global batch
(`tf.nn.compute_average_loss`), a `GradientTape`, and tf_keras optimizers applied in the
replica, which sum the gradients over the workers (`ReplicaContext.all_reduce(SUM)`, from
`tf_keras.src.optimizers.utils.all_reduce_sum_gradients`). tf_keras (Keras 2) rather than
Keras 3: its legacy optimizers run the fused sparse kernels of the tf.compat.v1 optimizers the
reference models use (Adagrad; FTRL on recsys' wide part). MWMS broadcasts every variable's
initial value, the slots' included, from worker 0.

Sparse gradients stay IndexedSlices and are all-gathered, not densified: MWMS's
`CollectiveAllReduce._all_reduce` splits the gradients by sparsity, packs the dense ones into
ring all-reduces, and hands each IndexedSlices to
`CollectiveReplicaLauncher.all_reduce_indexed_slices`
(tensorflow/python/distribute/cross_device_utils.py, the copy in .venv): it all-gathers the
slices' lengths, then the values and the indices (padded to the longest when the workers'
lengths differ). Duplicate rows are summed by the optimizer's sparse apply, as under Horovod.

The models are the TF2 forms of models/lm.py and models/recsys.py (models/tf2_forms.py), fed the
same per-rank batches (the reference model's input_fn).

ParameterServerStrategy is not a baseline here, though it starts on this rig: under
tools.cluster (2 hosts) rank 0 serving the `chief` (the coordinator, in-process), a `ps` and
a `worker` task, each other rank a `worker` (addresses through Horovod as above), a
`ClusterCoordinator` ran 20 scheduled Adagrad steps on an embedding. What is missing is a
measurement that means what the other rows mean: the coordinator alone runs the loop and
`schedule` sends each step, with its batch as arguments from the coordinator, to whichever
worker is free, asynchronously, so the ranks have no steps of their own to time, no per-rank
step CPU, and the coordinator's link carries every batch. Fitting that into tools.bench's
per-rank figures is a design of its own, not done.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
import tensorflow as tf
from absl import flags

from models.tf2_forms import build, sizes_from_flags
from parallax_tf import threads as pool_threads
from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.model import RunContext
from parallax_tf.runtime import bind
from parallax_tf.runtime.cluster import free_ports
from parallax_tf.runtime.hooks import StepStats
from tools import link_counters

FLAGS = flags.FLAGS
HEARTBEAT_TIMEOUT_S = 600


def run(input_fn, steps: int, profile_from: int = -1) -> dict:
    """Trains --model for `steps` steps as one MWMS worker; the figures of baselines._loop."""
    import horovod.tensorflow as hvd
    strategy, threads = start_worker(hvd, FLAGS.threads)
    with strategy.scope():
        model = build(FLAGS.model, sizes_from_flags(FLAGS.model), rank=hvd.rank(), ranks=hvd.size())
    step = train_step(strategy, model)
    ctx = RunContext(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), 0)
    figures = _loop(step, input_fn, ctx, steps, profile_from)
    # the loss of the global batch: the ranks' means, averaged once at the end (not a
    # collective per step that the user's loop would not have)
    every = np.array(hvd.allgather_object(figures.pop("own_losses")))
    return {**figures, "losses": [float(x) for x in every.mean(axis=0)], "pool_threads": threads}


def start_worker(hvd, threads: str):
    """This rank as MWMS worker hvd.rank() of hvd.size(); TF's pools sized as the other runs'."""
    hvd.init()
    pool = pool_threads.choose(threads, hvd.local_size())
    tf.config.threading.set_inter_op_parallelism_threads(pool)
    tf.config.threading.set_intra_op_parallelism_threads(pool)
    address = bind.choose_address(None)
    port = free_ports(address, 1, None, hvd.local_rank())[0]
    # in a graph and session of its own: an eager op would start TF's eager runtime, after which
    # MWMS can no longer configure its collectives ("must be configured at program startup")
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:
        workers = hvd.allgather_object(f"{address}:{port}", session=session)
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers},
                                          "task": {"type": "worker", "index": hvd.rank()}})
    # TF's default heartbeat bound (10 s) ends the job while worker 0's first broadcast of the
    # variables (26 MB for lm) fills a slow link's queue ahead of the heartbeats' replies; a
    # user on such a link raises it, as here
    tf_shim.configure_coordination_service("/job:worker/replica:0/task:0", len(workers), HEARTBEAT_TIMEOUT_S)
    ring = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=ring), pool


def _loop(step, input_fn, ctx, steps, profile_from) -> dict:
    # traced before the loop: the trace creates the optimizers' slots, which MWMS initialises by
    # a broadcast from worker 0 (26 MB for lm's Adagrad), a set-up the other runs do before
    # their loops too
    step.get_concrete_function(_batch(input_fn, ctx))
    stats, examples, losses = StepStats(profile_from), 0, []
    link_before = link_counters.read() if ctx.local_rank == 0 else None
    for number in range(steps):
        ctx.step = number
        batch = _batch(input_fn, ctx)
        begin = time.perf_counter()
        loss = float(step(batch))         # reading the loss waits for the step
        examples = len(next(iter(batch.values()))) * ctx.size
        stats.add(time.perf_counter() - begin, {}, examples)
        losses.append(loss)
    link_after = link_counters.read() if link_before else None
    return {"step_times": stats.times, "examples_per_step": examples, "step_cpu_s": stats.cpu_times,
            "thread_cpu_s_per_step": stats.thread_cpu_per_step(), "own_losses": losses,
            "link_bytes": link_counters.difference(link_before, link_after)}


def _batch(input_fn, ctx) -> dict:
    return {name: tf.constant(value) for name, value in input_fn(ctx).items()}


def train_step(strategy, model):
    """The tf.function of one step: each replica's loss, gradients and the optimizers' applies
    (which all-reduce the gradients); returns this worker's mean loss."""
    def replica_step(batch):
        with tf.GradientTape() as tape:
            losses = model.losses(batch)
            scaled = tf.nn.compute_average_loss(losses, global_batch_size=model.global_rows(batch))
        grads = tape.gradient(scaled, model.variables)
        for optimizer, chosen in model.optimizers:
            optimizer.apply_gradients([(grads[i], model.variables[i]) for i in chosen])
        return tf.reduce_mean(losses)

    @tf.function
    def step(batch):
        return strategy.experimental_local_results(strategy.run(replica_step, args=(batch,)))[0]
    return step


def one_device_losses(name: str, sizes: dict, input_fn, steps: int, ranks: int) -> list:
    """The same TF2 model and optimizers on one device, each step fed the `ranks` ranks'
    batches joined: what tf_mwms on `ranks` workers computes (recsys; lm samples per rank)."""
    model = build(name, sizes)
    step = train_step(tf.distribute.get_strategy(), model)
    losses = []
    for number in range(steps):
        parts = [input_fn(RunContext(r, ranks, 0, 1, number)) for r in range(ranks)]
        batch = {key: tf.constant(np.concatenate([p[key] for p in parts])) for key in parts[0]}
        losses.append(float(step(batch)))
    return losses
