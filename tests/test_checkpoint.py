"""Checkpoints: plain-TF restore under single-device names, exact resume, another rank count.

The tests' runs share three jobs (tests/jobs/train_case.py --runs): the first runs on 2 ranks,
the resumes on 2 ranks, the resumes on 3; each run has its own --out and --ckpt_dir."""
import functools
import json
import os
import tempfile

import numpy as np
import pytest
import tensorflow as tf

from tests import cases, launch, reference

RESUMED = ("hybrid", "ps", "allreduce")
SAVER_CASES = ("partitioned", "auto_mod", "mixed_adam")
# name -> (ranks, case, flags of its first run, of its resume or None); a resume's job runs after
# every first run's
RUNS = {
    **{f"resumed_{s}": (2, "mixed_adam", [f"--strategy={s}", "--steps=3", "--ckpt_every=3"], [f"--strategy={s}",
                                                                                             "--steps=6"])
       for s in RESUMED},
    "schedule": (3, "clip_decay_sgd", ["--steps=3", "--ckpt_every=3"], ["--steps=6"]),
    "keras": (None, "keras_bn", ["--steps=3", "--strategy=allreduce"], None),
    "other_ranks": (3, "mixed_momentum", ["--steps=3", "--ckpt_every=1", "--ckpt_keep=2"], ["--steps=5"]),
    "rank_held": (3, "mixed_adam", ["--strategy=collective", "--steps=3", "--ckpt_every=3"],
                  ["--strategy=collective", "--steps=6"]),
    **{f"saver_{case}": (None, case, ["--steps=3", "--partitions=4"], None) for case in SAVER_CASES},
    "init_iter": (2, "init_iter", ["--steps=3", "--ckpt_every=3"], ["--steps=5"]),
}


@functools.lru_cache(maxsize=None)
def _dirs(name):
    """(out, ckpt_dir) of the run `name`, first run and resume alike."""
    return tempfile.mkdtemp(prefix=f"ptf-{name}-out-"), tempfile.mkdtemp(prefix=f"ptf-{name}-ckpt-")


def _job(size, runs):
    given = [{"flags": [f"--case={case}", f"--out={_dirs(name)[0]}", f"--ckpt_dir={_dirs(name)[1]}", "--log_every=0",
                        *flags]} for name, case, flags in runs]
    proc = launch.run_ranks(size, ["tests/jobs/train_case.py", f"--runs={json.dumps(given)}"])
    assert proc.returncode == 0, launch.tail(proc)


@functools.lru_cache(maxsize=None)
def _first_runs():
    """Every first run, saved in the 2-rank job (it returns once they all ended): name -> (its
    ranks' results, its checkpoint directory's listing)."""
    _job(2, [(name, case, first) for name, (_, case, first, _) in RUNS.items()])
    return {name: (_ranks(name, RUNS[name][1], 2), sorted(os.listdir(_dirs(name)[1]))) for name in RUNS}


@functools.lru_cache(maxsize=None)
def _resumes(size):
    """Every resume on `size` ranks, after the first runs."""
    _first_runs()
    _job(size, [(name, case, resume) for name, (ranks, case, _, resume) in RUNS.items() if ranks == size])
    return {name: _ranks(name, RUNS[name][1], size) for name, (ranks, *_) in RUNS.items() if ranks == size}


def _ranks(name, case, size):
    # a resume overwrites its first run's files: read them now (not the pickled byte counts)
    files = [np.load(os.path.join(_dirs(name)[0], f"{case}.rank{r}.npz")) for r in range(size)]
    return [{key: f[key] for key in f.files if key != "bytes"} for f in files]


def _first(name):
    return _first_runs()[name][0]


def _resumed(name):
    return _resumes(RUNS[name][0])[name]


def _listing(name):
    """The checkpoint directory of `name` as its first run left it."""
    return _first_runs()[name][1]


def _assert_close(got, want, tolerance, what):
    for name, value in want.items():
        error = reference.relative_error(got[f"var:{name}"], value)
        assert error <= tolerance, f"{what}/{name}: relative error {error:.2e}"


@pytest.mark.parametrize("strategy", RESUMED)
def test_interrupted_and_resumed_run_matches_uninterrupted(strategy):
    name = f"resumed_{strategy}"
    first = _first(name)
    assert int(first[0]["global_step"]) == 3 and _listing(name) == ["checkpoint", "step-3"]
    second = _resumed(name)
    assert [int(r["start_step"]) for r in second] == [3, 3]
    assert [int(r["global_step"]) for r in second] == [6, 6]
    assert len(second[0]["losses"]) == 3          # only the remaining steps ran
    _assert_close(second[0], reference.train_single_device("mixed", "adam", 2, steps=6), 1e-4, strategy)


def test_resumed_run_continues_the_learning_rate_schedule():
    """clip_decay: exponential decay on the model's own global step, clipped by global norm."""
    _first("schedule")
    reader = tf.train.load_checkpoint(os.path.join(_dirs("schedule")[1], "step-3", "model"))
    names = reader.get_variable_to_shape_map()
    assert reader.get_tensor("global_step") == 3 and "parallax_global_step" not in names
    second = _resumed("schedule")
    assert int(second[0]["start_step"]) == 3 and int(second[0]["global_step"]) == 6
    want = reference.train_single_device("clip_decay", "sgd", [2, 2, 2, 3, 3, 3], steps=6)
    _assert_close(second[0], want, 1e-5, "clip_decay resumed")


def test_keras_checkpoint_restores_into_the_single_device_keras_model():
    ranks = _first("keras")
    graph = tf.Graph()
    with graph.as_default():
        cases.build("keras_bn", "sgd")()
        with tf.compat.v1.Session(graph=graph) as sess:
            tf.compat.v1.train.Saver().restore(sess, tf.train.latest_checkpoint(_dirs("keras")[1]))
            assert sess.run(tf.compat.v1.train.get_global_step()) == 3
            variables = {v.op.name: sess.run(v) for v in tf.compat.v1.global_variables()}
    for name in ranks[0]:
        if name.startswith("var:"):
            np.testing.assert_array_equal(variables[name[4:]], ranks[0][name])
    assert {"sequential/bn_mid/moving_mean", "sequential/bn_mid/moving_variance"} <= {n[4:] for n in ranks[0]}


def test_resume_on_a_different_number_of_ranks():
    assert _listing("other_ranks") == ["checkpoint", "step-2", "step-3"]     # only the last 2 kept
    third = _resumed("other_ranks")
    want = reference.train_single_device("mixed", "momentum", [2, 2, 2, 3, 3], steps=5)
    _assert_close(third[0], want, 1e-5, "2 then 3 ranks")


def test_rank_held_shards_are_saved_whole_and_resume_on_another_number_of_ranks():
    """Strategy collective: each rank holds its rows of the table and of Adam's slots; the
    checkpoint has them whole, under single-device names, and 3 ranks resume 2 ranks' run."""
    first = _first("rank_held")
    assert json.loads(str(first[0]["routes"]))["emb"] == "alltoall"
    saved = dict(tf.train.list_variables(os.path.join(_dirs("rank_held")[1], "step-3", "model")))
    assert saved["emb"] == saved["emb/Adam"] == saved["emb/Adam_1"] == [20, 4]
    third = _resumed("rank_held")
    assert [int(r["start_step"]) for r in third] == [3, 3, 3]
    want = reference.train_single_device("mixed", "adam", [2, 2, 2, 3, 3, 3], steps=6)
    _assert_close(third[0], want, 1e-4, "collective, 2 then 3 ranks")
    for other in third[1:]:
        np.testing.assert_array_equal(other["var:emb"], third[0]["var:emb"])


@pytest.mark.parametrize("case", SAVER_CASES)
def test_plain_saver_restores_into_the_single_device_graph(case):
    ranks = _first(f"saver_{case}")
    _, model, optimizer, _ = cases.CASE_BY_NAME[case]
    want = reference.train_single_device(model, optimizer, 2, steps=3, with_slots=True)
    graph = tf.Graph()
    with graph.as_default():
        built = cases.build(model, optimizer)()
        built.optimizer.minimize(built.loss)
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session(graph=graph) as sess:
            saver.restore(sess, tf.train.latest_checkpoint(_dirs(f"saver_{case}")[1]))
            restored = reference._whole_values(sess)
            restored.update(reference._slot_values(sess, built.optimizer))
            if optimizer == "adam":
                beta1, _ = built.optimizer._get_beta_accumulators()
                assert sess.run(beta1) == pytest.approx(0.9 ** 4)
    assert set(restored) == set(want)
    tolerance = 1e-4 if optimizer == "adam" else 1e-5
    for name, value in want.items():      # model variables and every slot
        assert reference.relative_error(restored[name], value) <= tolerance, name
    for name in ranks[0]:
        if name.startswith("var:"):
            np.testing.assert_array_equal(restored[name[4:]], ranks[0][name])


def test_an_initializable_iterator_continues_where_the_resumed_run_stopped():
    """The iterator is initialised afresh on resume and advanced past the steps already trained."""
    second = _resumed("init_iter")
    assert [int(r["start_step"]) for r in second] == [3, 3] and int(second[0]["global_step"]) == 5
    _assert_close(second[0], reference.train_single_device("init_iter", "sgd", 2), 1e-5, "init_iter resumed")
