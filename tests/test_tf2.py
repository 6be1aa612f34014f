"""TF2 training steps (ptf.run(train_step, dataset)) and Keras 3 ptf.fit against the same script
on one device, on real ranks (tests/jobs/tf2_job.py), and what the TF2 front end refuses."""
import functools
import json
import os
import re
import tempfile

import numpy as np
import pytest
import tensorflow as tf

import parallax_tf as ptf
from tests import launch, reference

STRATEGIES = ["hybrid", "ps", "allreduce", "collective", "auto"]
# run with --partitions=7: the table (60 rows) split into 7 shards where its updates allow it
SPLIT = ("module_split", "tf_keras_adagrad_split", "legacy_ftrl_split", "keras3_wide_split")
# one job per rank count, each run a case on a strategy (tests/jobs/tf2_cases.py)
RUNS = {2: [f"{case}:{strategy}" for case in ("keras3_wide", "module") for strategy in STRATEGIES]
        + ["keras3_metric:hybrid", "tf_keras_adagrad:hybrid", "keras3_fit_mlp:hybrid", "keras3_fit_wide:hybrid",
           "module_shard_reading:hybrid", "guide_training_loop:hybrid", "structured_fit:hybrid",
           "keras3_fit_dynamic:hybrid", "keras3_fit_dynamic:auto"]
        + [f"{case}:hybrid" for case in SPLIT],
        3: ["keras3_wide:hybrid", "module:ps", "tf_keras_adagrad:collective", "keras3_metric:allreduce",
            "keras3_fit_wide:ps", "module_shard_reading:allreduce", "module_split:ps", "legacy_ftrl_split:hybrid",
            "keras3_fit_dynamic:hybrid"]}
ADAM = ("keras3_wide", "keras3_fit_mlp", "keras3_fit_wide", "structured_fit", "keras3_wide_split")


@functools.lru_cache(maxsize=None)
def _job(ranks: int) -> str:
    """The 2-rank job starts as `python tf2_job.py --np 2`, the 3-rank one under horovodrun."""
    out = tempfile.mkdtemp(prefix="ptf-tf2-")
    argv = ["tests/jobs/tf2_job.py", f"--runs={','.join(RUNS[ranks])}", f"--out={out}"]
    proc = launch.run_ranks(1, argv + [f"--np={ranks}"], launcher="python", timeout=500) if ranks == 2 else \
        launch.run_ranks(ranks, argv, timeout=500)
    assert proc.returncode == 0, launch.tail(proc)
    return out


def _check(out: str, case: str, strategy: str, ranks: int) -> dict:
    tolerance = 1e-4 if case in ADAM else 1e-5
    for rank in range(ranks):
        saved = np.load(os.path.join(out, f"{case}.{strategy}.rank{rank}.npz"))
        count = len([k for k in saved.files if k.startswith("got:")])
        assert count and count == len([k for k in saved.files if k.startswith("want:")])
        for i in range(count):       # the script's own variables, on every rank
            error = reference.relative_error(saved[f"got:{i}"], saved[f"want:{i}"])
            assert error <= tolerance, (rank, i, error)
        np.testing.assert_allclose(saved["losses"], saved["reference_losses"], rtol=tolerance)
    return json.loads(str(saved["extra"]))


@pytest.mark.parametrize("ranks,run", [(ranks, run) for ranks, runs in RUNS.items() for run in runs])
def test_a_tf2_step_trains_as_on_one_device(ranks, run):
    case, strategy = run.split(":")
    extra = _check(_job(ranks), case, strategy, ranks)
    if case == "guide_training_loop":      # the metrics of each epoch, training and validation
        np.testing.assert_allclose(extra["logs"], extra["reference_logs"], rtol=1e-6)
    if case.startswith("keras3_fit") or case == "structured_fit":     # History as model.fit's
        got, want = extra["history"], extra["reference_history"]
        assert sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-4, err_msg=key)
    if case == "keras3_fit_dynamic":       # predict reads the trained table's rows after fit
        np.testing.assert_allclose(extra["predict"], extra["reference_predict"], rtol=1e-5)
        # auto replicates the small table on the ranks (no servers on one host's fast link)
        assert extra["table_routes"] == ["replicated" if strategy == "auto" else "servers"]
    if case == "keras3_metric":            # the metric's state over every rank, as on one device
        assert extra["count"] == pytest.approx(extra["reference_count"], rel=1e-6)
        assert extra["accuracy"] == pytest.approx(extra["reference_accuracy"], rel=1e-6)


def test_the_table_is_on_the_parameter_servers_under_hybrid():
    """The embedding (Keras 3's, and a tf.Module's table) goes to the PS, the dense variables
    through AllReduce; under collective the hand-written table is split over the ranks, while
    Adam's, which squares every looked-up row, is allgathered (alltoall sums repeated ids)."""
    def routes(run: str, word: str) -> set:     # Keras names layers after those made before in the job
        plan = json.loads(str(np.load(os.path.join(_job(2), f"{run}.rank0.npz"))["extra"]))["plan"]
        return {route for name, route in plan.items() if word in name}
    assert routes("keras3_wide.hybrid", "embedding") == {"ps"}
    assert routes("keras3_wide.hybrid", "dense") == {"allreduce"}
    assert routes("module.hybrid", "table") == {"ps"} and routes("module.hybrid", "w") == {"allreduce"}
    assert routes("module.collective", "table") == {"alltoall"}
    assert routes("keras3_wide.collective", "embedding") == {"allreduce"}


def test_a_table_whose_updates_are_row_by_row_is_split_into_the_plans_shards():
    """A hand-written scatter, tf_keras' Adagrad and the legacy fused FTRL update a table row by
    row: the plan splits it (--partitions=7, uneven shards) and it trains exactly (above). Keras
    3's Adam writes the whole table, so it stays whole and the plan says why."""
    def plan(run: str, ranks: int = 2) -> dict:
        return json.loads(str(np.load(os.path.join(_job(ranks), f"{run}.rank0.npz"))["extra"]))
    for run, table in [("module_split.hybrid", "table"), ("tf_keras_adagrad_split.hybrid", "embedding"),
                       ("legacy_ftrl_split.hybrid", "embedding")]:
        shards = {name: count for name, count in plan(run)["shards"].items() if table in name}
        assert list(shards.values()) == [7], (run, shards)
    assert plan("module_split.ps", 3)["shards"] == {"table": 7, "w": 1}
    reasons = {name: why for name, why in plan("keras3_wide_split.hybrid")["reasons"].items() if "embedding" in name}
    [why] = reasons.values()       # Keras names the optimizer after those made before it in the job
    assert re.fullmatch(r"not partitioned: the step reads or writes it whole \(AssignSubVariableOp "
                        r"step/adam(_\d+)?/AssignSubVariableOp\)", why.split("; ")[-1]), why


def test_a_killed_rank_restarts_from_the_checkpoint_and_ends_exactly():
    out, ckpt = tempfile.mkdtemp(prefix="ptf-tf2-die-"), tempfile.mkdtemp(prefix="ptf-tf2-ckpt-")
    argv = ["tests/jobs/tf2_job.py", "--runs=keras3_wide:hybrid", f"--out={out}", "--np=2", f"--ckpt_dir={ckpt}",
            "--ckpt_every=1", "--max_restarts=1", "--die_at_step=2", "--die_rank=1", "--log_every=0"]
    proc = launch.run_ranks(1, argv, launcher="python", timeout=300)
    assert proc.returncode == 0, launch.tail(proc)
    assert os.path.exists(os.path.join(out, "died_at")) and "restart" in (proc.stdout + proc.stderr).lower()
    for rank in range(2):
        saved = np.load(os.path.join(out, f"keras3_wide.hybrid.rank{rank}.npz"))
        for i in range(len([k for k in saved.files if k.startswith("got:")])):
            assert reference.relative_error(saved[f"got:{i}"], saved[f"want:{i}"]) <= 1e-4


def test_a_legacy_optimizers_hyper_parameters_are_read_as_constants():
    """The legacy Ftrl's learning rate, l1, l2 and beta are variables the step only reads: rank
    0's step reads them as constants of the run's start, which placement makes again beside
    every shard's apply; the other ranks read their variables (rank 0's values after the start's
    broadcast). The variables stay (checkpoints and results hold them)."""
    import tf_keras
    from parallax_tf.graph_walk import ancestors
    from parallax_tf.model import RunContext
    from parallax_tf.tf2 import StepFrontEnd
    table = tf.Variable(np.ones([6, 2], np.float32), name="table")
    optimizer = tf_keras.optimizers.legacy.Ftrl(0.3, l1_regularization_strength=0.01, beta=0.5)

    @tf.function
    def step(ids, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.reduce_sum(tf.gather(table, ids), 1) - y)
        optimizer.apply_gradients([(tape.gradient(loss, table), table)])
        return loss
    ids = tf.data.Dataset.from_tensor_slices((np.arange(8) % 6, np.ones([8], np.float32))).batch(4)
    front = StepFrontEnd(step, ids)
    fixed = {v.name.split(":")[0] for v in front.converter.fixed_reads.values()}    # traced eagerly, as ptf.run does
    assert fixed == {f"Ftrl/{name}" for name in ("learning_rate", "learning_rate_power", "l1_regularization_strength",
                                                 "l2_regularization_strength", "beta")}
    with tf.Graph().as_default() as graph:
        front.build(RunContext())
    [apply] = [op for op in graph.get_operations() if op.type == "ResourceSparseApplyFtrl"]
    hyper = apply.inputs[5:]            # lr, l1, l2, lr_power
    assert all("ReadVariableOp" not in {op.type for op in ancestors(t.op)} for t in hyper)
    assert [tf.get_static_value(t) for t in hyper[:2]] == [np.float32(0.3), np.float32(0.01)]
    held = {v.op.name for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)}
    assert {"Ftrl/learning_rate", "Ftrl/beta"} <= held
    with tf.Graph().as_default() as other_rank:
        front.build(RunContext(rank=1, size=2))
    [apply] = [op for op in other_rank.get_operations() if op.type == "ResourceSparseApplyFtrl"]
    assert all("ReadVariableOp" in {op.type for op in ancestors(t.op)} for t in apply.inputs[5:8])


# ---- what the front end refuses, each in one line (inspection on one process: --plan_only) ----

def _dataset():
    return tf.data.Dataset.from_tensor_slices((np.ones([8, 2], np.float32), np.ones([8, 1], np.float32))).batch(4)


def _variables():
    return tf.Variable(np.ones([2, 1], np.float32), name="w")


def test_a_step_that_returns_no_loss_is_named():
    w = _variables()

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.matmul(x, w) - y)
        w.assign_sub(0.1 * tape.gradient(loss, w))
    with pytest.raises(ptf.ModelError, match=r"^the training step returned nothing as 'loss'; return a scalar loss"):
        ptf.run(step, _dataset(), plan_only=True)


def test_a_step_without_a_gradient_tape_is_named():
    w = _variables()

    def step(x, y):
        w.assign_sub(0.1 * tf.ones_like(w))
        return tf.reduce_mean(tf.matmul(x, w) - y)
    with pytest.raises(ptf.ModelError, match=r"^the training step computed no gradient: compute them with "
                                              r"tf.GradientTape"):
        ptf.run(step, _dataset(), plan_only=True)


def test_a_step_that_updates_nothing_is_named():
    w = _variables()

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.matmul(x, w) - y)
        tape.gradient(loss, w)
        return loss
    with pytest.raises(ptf.ModelError, match=r"^the training step updates no variable from its gradients"):
        ptf.run(step, _dataset(), plan_only=True)


def test_a_strategy_that_cannot_take_a_tf2_step_says_so():
    w = _variables()

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.matmul(x, w) - y)
        w.assign_sub(0.1 * tape.gradient(loss, w))
        return loss
    with pytest.raises(ptf.ConfigError, match=r"^--strategy=slim_dp cannot train a TF2 training step yet .*; use one "
                                               r"of hybrid, ps, allreduce, collective, auto"):
        ptf.run(step, _dataset(), plan_only=True, strategy="slim_dp")


def test_the_plan_names_the_steps_variables_by_their_keras_paths():
    import keras
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="out")])
    optimizer = keras.optimizers.SGD(0.1)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss
    plan = ptf.run(step, _dataset(), plan_only=True, np=2).plan
    # the model's own name depends on the Keras models made before it in this process
    model_name = model.name
    assert {v.name: v.route for v in plan.variables} == {f"{model_name}/out/kernel": "allreduce",
                                                         f"{model_name}/out/bias": "allreduce"}


def test_the_trained_state_is_read_back_in_runs_of_bounded_size():
    """Each session run of the read-back (every rank's write-back) is a wait of its own under
    --timeout_s: no run moves more than 8 MB, unless one piece alone is larger."""
    from parallax_tf import values
    mb = 1 << 20
    sizes = {"a": 5 * mb, "b": 2 * mb, "c": 3 * mb, "d": 20 * mb, "e": 1 * mb}
    assert values._batches(sorted(sizes), sizes) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert values._batches([], {}) == []
