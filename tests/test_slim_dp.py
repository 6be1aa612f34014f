"""Slim-DP on real ranks: the degenerate case (core 1, explore 0, period 1) equals single-device
training; a partial selection equals a single-process reference of the algorithm, written here
(gradients from plain TF, the rest in NumPy, core and explored sets from the toolkit's op, which
tests/test_ops.py checks against NumPy); bytes follow the selected counts; checkpoints resume."""
import functools
import json
import os
import tempfile

import numpy as np
import pytest
import tensorflow as tf

from tests import cases, launch, reference
from tests.test_equivalence import _check_case

DEGENERATE = ["--slim_core=1", "--slim_explore=0", "--slim_period=1"]
DEGENERATE_CASES = ("mixed_sgd", "mixed_momentum", "mixed_adam", "dense_only", "keras", "keras_momentum", "keras_adam",
                    "vocab_column", "init_iter")
# w1 is 4x5 (core 5, explored 5), w2 5x3 (core 4, explored 4); rounds every 2 steps; the core
# set refreshed every 2 rounds.
PARTIAL = {"core": 0.25, "explore": 0.25, "period": 2, "refresh": 2, "lambda": 1.0}
PARTIAL_STEPS = 8


@functools.lru_cache(maxsize=None)
def degenerate_output(size: int) -> str:
    out = tempfile.mkdtemp(prefix=f"ptf-slim-{size}-")
    proc = launch.run_ranks(size, ["tests/jobs/equivalence_job.py", out, "slim_dp", *DEGENERATE_CASES, *DEGENERATE])
    assert proc.returncode == 0, f"slim_dp job failed:\n{launch.tail(proc)}"
    return out


@pytest.mark.parametrize("size", (2, 3))
@pytest.mark.parametrize("name", DEGENERATE_CASES)
def test_degenerate_slim_dp_is_synchronous_data_parallelism(name, size):
    _check_case(degenerate_output(size), name, size)


def _partial_flags(error_feedback: bool):
    return [f"--slim_core={PARTIAL['core']}", f"--slim_explore={PARTIAL['explore']}",
            f"--slim_period={PARTIAL['period']}", f"--slim_refresh={PARTIAL['refresh']}",
            f"--slim_lambda={PARTIAL['lambda']}", f"--slim_error_feedback={str(error_feedback).lower()}"]


def partial_output(error_feedback: bool) -> str:
    return _two_rank_runs()[f"partial_{error_feedback}"]


@functools.lru_cache(maxsize=None)
def checkpoint_dir() -> str:
    return tempfile.mkdtemp(prefix="ptf-slim-ckpt-")


@functools.lru_cache(maxsize=None)
def _two_rank_runs() -> dict:
    """The partial selections' runs and the interrupted run, in one 2-rank job (tests/jobs/several_runs.py)."""
    outs = {name: tempfile.mkdtemp(prefix=f"ptf-slim-{name}-") for name in ("partial_False", "partial_True",
                                                                             "interrupted")}
    runs = [[f"--out={outs[f'partial_{feedback}']}", "--case=dense_only", f"--steps={PARTIAL_STEPS}",
             "--measure_every=1", *_partial_flags(feedback)] for feedback in (False, True)]
    runs.append([f"--out={outs['interrupted']}", "--case=mixed_adam", *DEGENERATE, "--steps=3",
                 f"--ckpt_dir={checkpoint_dir()}", "--ckpt_every=3"])
    given = [{"flags": ["--strategy=slim_dp", "--log_every=0", *flags]} for flags in runs]
    proc = launch.run_ranks(2, ["tests/jobs/train_case.py", f"--runs={json.dumps(given)}"])
    assert proc.returncode == 0, f"slim_dp job failed:\n{launch.tail(proc)}"
    return outs


def slim_reference(size: int, steps: int, error_feedback: bool, seed: int = 0):
    """The Slim-DP rule of rewriters/slim_dp/route.py for the dense_only case (Momentum 0.1,
    0.9), one process: each rank's replica takes local Momentum steps on its own batch and sums
    its gradients; every `period` steps the mean of the sums at core + explored coordinates is
    applied to the global copy by a dense Momentum update (gradient zero at the other
    coordinates), remembered as the last aggregated update, and copied into every replica."""
    from parallax_tf import ops as ptf_ops
    from rewriters.slim_dp.route import selection_sizes, unit_seed
    lr, momentum = 0.1, 0.9
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        built = cases.build("dense_only", "momentum")()
        variables = tf.compat.v1.trainable_variables()
        grads = tf.gradients(built.loss, variables)
        holders = [tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape) for v in variables]
        load = [v.assign(h) for v, h in zip(variables, holders)]
        sess = tf.compat.v1.Session(graph=graph)
        sess.run(tf.compat.v1.global_variables_initializer())
        initial = sess.run(variables)
    names = [v.op.name for v in variables]
    shapes = [w.shape for w in initial]
    g_copy = [w.reshape(-1).copy() for w in initial]
    g_slot = [np.zeros_like(w) for w in g_copy]
    update = [np.zeros_like(w) for w in g_copy]
    replicas = [[w.copy() for w in g_copy] for _ in range(size)]
    slots = [[np.zeros_like(w) for w in g_copy] for _ in range(size)]
    sums = [[np.zeros_like(w) for w in g_copy] for _ in range(size)]
    sizes = [selection_sizes(w.size, PARTIAL["core"], PARTIAL["explore"]) for w in g_copy]
    seeds = [unit_seed(seed, name, 0) for name in names]

    def select(i, round_index):
        with tf.Graph().as_default(), tf.compat.v1.Session() as s:
            core, _ = ptf_ops.significance_select(g_copy[i], update[i], PARTIAL["lambda"], seeds[i], round_index,
                                                  sizes[i][0], 0)
            return s.run(core)

    def explored(i, core, round_index):
        with tf.Graph().as_default(), tf.compat.v1.Session() as s:
            return s.run(ptf_ops.explore_indices(core, g_copy[i].size, seeds[i], round_index, sizes[i][1]))

    cores = [select(i, 0) for i in range(len(names))]
    for step in range(steps):
        for rank in range(size):
            feeds = {graph.get_tensor_by_name(k + ":0"): v for k, v in cases.batch("dense_only", rank, step).items()}
            sess.run(load, {h: w.reshape(s) for h, w, s in zip(holders, replicas[rank], shapes)})
            for i, g in enumerate(sess.run(grads, feeds)):
                g = g.reshape(-1)
                slots[rank][i] = momentum * slots[rank][i] + g
                replicas[rank][i] = replicas[rank][i] - lr * slots[rank][i]
                sums[rank][i] = sums[rank][i] + g
        if (step + 1) % PARTIAL["period"]:
            continue
        round_index = (step + 1) // PARTIAL["period"] - 1
        for i in range(len(names)):
            sel = np.sort(np.concatenate([cores[i], explored(i, cores[i], round_index)]))
            mean = np.mean([sums[r][i][sel] for r in range(size)], axis=0)
            dense = np.zeros_like(g_copy[i])
            dense[sel] = mean
            g_slot[i] = momentum * g_slot[i] + dense      # every coordinate's momentum moves on
            g_copy[i] = g_copy[i] - lr * g_slot[i]
            update[i][sel] = mean
            for rank in range(size):
                replicas[rank][i][sel] = g_copy[i][sel]
                if error_feedback:
                    sums[rank][i][sel] = 0
                else:
                    sums[rank][i][:] = 0
            if (round_index + 1) % PARTIAL["refresh"] == 0:
                cores[i] = select(i, round_index)
    sess.close()
    return {name: w.reshape(s) for name, w, s in zip(names, g_copy, shapes)}, sizes


@pytest.mark.parametrize("error_feedback", (False, True))
def test_partial_selection_matches_the_reference(error_feedback):
    out = partial_output(error_feedback)
    want, _ = slim_reference(2, PARTIAL_STEPS, error_feedback)
    ranks = [np.load(os.path.join(out, f"dense_only.rank{r}.npz")) for r in range(2)]
    initial = reference.train_single_device("dense_only", "momentum", 2, steps=0)
    synchronous = reference.train_single_device("dense_only", "momentum", 2, steps=PARTIAL_STEPS)
    for name, value in want.items():
        got = ranks[0][f"var:{name}"]
        assert reference.relative_error(got, value) <= 1e-7, f"{name}: {reference.relative_error(got, value):.2e}"
        np.testing.assert_array_equal(ranks[1][f"var:{name}"], got)
        assert reference.relative_error(got, initial[name]) > 1e-3, "the global copy did not move"
        # only part of each variable is synchronised: not what synchronous training gives
        assert reference.relative_error(got, synchronous[name]) > 1e-4
    assert int(ranks[0]["global_step"]) == PARTIAL_STEPS


def test_bytes_follow_the_selected_counts():
    """Rank 1 (its PS is rank 0's process) moves, per round, the selected values of every piece
    both ways, plus the core sets on refresh rounds; rank 0 serves them in-process (every step
    counted: --measure_every=1)."""
    out = partial_output(False)
    _, sizes = slim_reference(2, 0, False)
    rounds = PARTIAL_STEPS // PARTIAL["period"]
    refreshes = rounds // PARTIAL["refresh"]
    values = sum(2 * (core + explore) * 8 for core, explore in sizes)       # float64 both ways
    cores = sum(4 * core for core, _ in sizes)                              # int32 core sets
    want = (rounds * values + refreshes * cores) / PARTIAL_STEPS
    got = {r: dict(np.load(os.path.join(out, f"dense_only.rank{r}.npz"), allow_pickle=True)["bytes"].item())
           for r in range(2)}
    assert got[1]["significant"] == pytest.approx(want)
    assert got[0]["significant"] == 0


def test_degenerate_run_resumes_from_its_checkpoint():
    """Interrupted after 3 steps and resumed to 6: the single-device result, and a checkpoint
    holding the global copies and their slots under single-device names."""
    ckpt = checkpoint_dir()
    _two_rank_runs()
    keys = set(tf.train.load_checkpoint(os.path.join(ckpt, "step-3", "model")).get_variable_to_shape_map())
    assert {"w", "w/Adam", "w/Adam_1", "b", "emb", "emb/Adam", "beta1_power", "parallax_global_step"} <= keys
    assert not any("parallax_global/" in k or "local_sum" in k for k in keys), sorted(keys)
    out = tempfile.mkdtemp()
    proc = launch.run_ranks(2, ["tests/jobs/train_case.py", "--case=mixed_adam", f"--out={out}", "--strategy=slim_dp",
                                "--log_every=0", *DEGENERATE, "--steps=6", f"--ckpt_dir={ckpt}"])
    assert proc.returncode == 0, launch.tail(proc)
    second = [np.load(os.path.join(out, f"mixed_adam.rank{r}.npz")) for r in range(2)]
    assert [int(r["start_step"]) for r in second] == [3, 3]
    want = reference.train_single_device("mixed", "adam", 2, steps=6)
    for name, value in want.items():
        assert reference.relative_error(second[0][f"var:{name}"], value) <= 1e-4, name
