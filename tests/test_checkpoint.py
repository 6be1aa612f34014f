"""Checkpoints: plain-TF restore under single-device names, exact resume, another rank count,
a moved or copied checkpoint directory.

The tests' runs share three jobs (tests/jobs/train_case.py --runs): the first runs on 2 ranks,
the resumes on 2 ranks, the resumes on 3; each run has its own --out and --ckpt_dir (a
relocated run's resume: its first run's directory moved or copied, between the jobs)."""
import functools
import json
import os
import shutil
import tempfile

import numpy as np
import pytest
import tensorflow as tf

from parallax_tf import api
from parallax_tf.checkpoint import CheckpointStore
from parallax_tf.errors import ConfigError
from tests import cases, launch, reference

RESUMED = ("hybrid", "ps", "allreduce")
# runs whose resume trains in their first run's checkpoint directory moved or copied elsewhere (_relocate)
RELOCATED = ("moved", "copied")
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
    **{name: (2, "mixed_adam", ["--steps=3", "--ckpt_every=3"], ["--steps=6"]) for name in RELOCATED},
}


@functools.lru_cache(maxsize=None)
def _dirs(name):
    """(out, ckpt_dir) of the run `name`, first run and resume alike."""
    return tempfile.mkdtemp(prefix=f"ptf-{name}-out-"), tempfile.mkdtemp(prefix=f"ptf-{name}-ckpt-")


def _resume_dir(name):
    """Where the run `name` resumes: its own --ckpt_dir, or the relocated copy of it."""
    return _dirs(name)[1] + f"-{name}" if name in RELOCATED else _dirs(name)[1]


def _job(size, runs, resumes=False):
    given = [{"flags": [f"--case={case}", f"--out={_dirs(name)[0]}",
                        f"--ckpt_dir={_resume_dir(name) if resumes else _dirs(name)[1]}", "--log_every=0", *flags]}
             for name, case, flags in runs]
    proc = launch.run_ranks(size, ["tests/jobs/train_case.py", f"--runs={json.dumps(given)}"])
    assert proc.returncode == 0, launch.tail(proc)


@functools.lru_cache(maxsize=None)
def _first_runs():
    """Every first run, saved in the 2-rank job (it returns once they all ended): name -> (its
    ranks' results, its checkpoint directory's listing)."""
    _job(2, [(name, case, first) for name, (_, case, first, _) in RUNS.items()])
    return {name: (_ranks(name, RUNS[name][1], 2), sorted(os.listdir(_dirs(name)[1]))) for name in RUNS}


def _old_form_index(directory, pointing_into):
    """A `checkpoint` index naming its checkpoints by absolute path (the form earlier versions
    wrote), here into another directory."""
    path = os.path.join(pointing_into, "step-3", "model")
    with open(os.path.join(directory, "checkpoint"), "w") as f:
        f.write(f'model_checkpoint_path: "{path}"\nall_model_checkpoint_paths: "{path}"\n')


@functools.lru_cache(maxsize=None)
def _relocate():
    """`moved`: its first run's directory renamed. `copied`: copied, the copy's index naming the
    original's step-3 by absolute path, and the original's step-3 then rewritten with other values
    (the model's variables plus 1): a resume that read it would not match the uninterrupted run."""
    _first_runs()
    os.rename(_dirs("moved")[1], _resume_dir("moved"))
    original = _dirs("copied")[1]
    shutil.copytree(original, _resume_dir("copied"))
    _old_form_index(_resume_dir("copied"), original)
    values, _ = CheckpointStore.load(os.path.join(original, "step-3", "model"))
    CheckpointStore(original).save({k: v + 1 if k in ("emb", "w", "b") else v for k, v in values.items()}, 3)


@functools.lru_cache(maxsize=None)
def _resumes(size):
    """Every resume on `size` ranks, after the first runs."""
    _first_runs()
    _relocate()
    _job(size, [(name, case, resume) for name, (ranks, case, _, resume) in RUNS.items() if ranks == size],
         resumes=True)
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


def _index(directory):
    with open(os.path.join(directory, "checkpoint")) as f:
        return f.read()


def test_a_moved_checkpoint_directory_resumes_from_its_own_latest_step():
    """`mv ckpt ckpt2`, then a run with --ckpt_dir ckpt2: it resumes at the moved directory's
    step 3 and ends as the uninterrupted run, leaving nothing where the directory was."""
    moved = _resume_dir("moved")
    second = _resumed("moved")
    assert [int(r["start_step"]) for r in second] == [3, 3] and [int(r["global_step"]) for r in second] == [6, 6]
    _assert_close(second[0], reference.train_single_device("mixed", "adam", 2, steps=6), 1e-4, "moved")
    assert str(second[0]["checkpoint"]) == os.path.join(moved, "step-6", "model")
    assert not os.path.exists(_dirs("moved")[1])
    assert sorted(os.listdir(moved)) == ["checkpoint", "step-3", "step-6"]
    # the index names its checkpoints relative to the directory: plain TF finds them after a move too
    assert _index(moved) == ('model_checkpoint_path: "step-6/model"\n'
                             'all_model_checkpoint_paths: "step-3/model"\nall_model_checkpoint_paths: "step-6/model"\n')
    assert tf.train.latest_checkpoint(moved) == os.path.join(moved, "step-6", "model")


def test_a_copy_resumes_from_its_own_checkpoint_while_the_original_exists():
    """The copy's index is the old absolute form, naming the original's step 3 (which holds other
    values by now): the resume reads the copy's step 3, and writes only into the copy."""
    copy, original = _resume_dir("copied"), _dirs("copied")[1]
    second = _resumed("copied")
    assert [int(r["start_step"]) for r in second] == [3, 3] and int(second[0]["global_step"]) == 6
    _assert_close(second[0], reference.train_single_device("mixed", "adam", 2, steps=6), 1e-4, "copied")
    assert sorted(os.listdir(copy)) == ["checkpoint", "step-3", "step-6"]
    assert sorted(os.listdir(original)) == ["checkpoint", "step-3"]
    assert original not in _index(copy) and 'model_checkpoint_path: "step-6/model"' in _index(copy)


def _saved(directory, steps, keep=3):
    store = CheckpointStore(directory, keep)
    for step in steps:
        store.save({"w": np.full([2], float(step), np.float32), "global_step": np.int64(step)}, step)
    return store


def test_an_old_form_index_is_never_followed_out_of_its_directory(tmp_path):
    """Absolute paths in the index, naming a directory that is gone or one that holds a newer
    step: the store's own newest step-N directory is the checkpoint."""
    own = str(tmp_path / "own")
    _saved(own, [2, 3])
    _old_form_index(own, str(tmp_path / "gone"))
    assert CheckpointStore(own).latest() == os.path.join(own, "step-3", "model")
    elsewhere = str(tmp_path / "elsewhere")
    _saved(elsewhere, [3, 9])
    with open(os.path.join(own, "checkpoint"), "w") as f:
        f.write(f'model_checkpoint_path: "{os.path.join(elsewhere, "step-9", "model")}"\n')
    assert api._newest([CheckpointStore(own), None]) == os.path.join(own, "step-3", "model")
    _saved(own, [4])              # the next save writes the index relative again
    assert _index(own).startswith('model_checkpoint_path: "step-4/model"\n')


def test_a_newer_step_without_a_complete_checkpoint_is_refused_not_passed_over(tmp_path):
    """step-5 lost its files (a copy cut short): resuming from step 3 would later overwrite it,
    so the run stops at the start and says which directory to delete."""
    directory = str(tmp_path / "ckpt")
    _saved(directory, [3, 5])
    os.remove(os.path.join(directory, "step-5", "model.index"))
    with pytest.raises(ConfigError) as error:
        api._start_values([CheckpointStore(directory)], None, None)
    assert str(error.value) == (f"checkpoint directory {directory}: step-5 holds no complete checkpoint (model.index "
                                f"is missing); delete {directory}/step-5 to go on from step-3")
    os.remove(os.path.join(directory, "step-3", "model.index"))
    shutil.rmtree(os.path.join(directory, "step-5"))
    with pytest.raises(ConfigError, match=r"step-3 holds no complete checkpoint .*; delete .*/step-3 to start afresh$"):
        CheckpointStore(directory).latest()


def test_a_checkpoint_older_than_one_in_the_directory_is_not_written(tmp_path):
    """Another run wrote step 5 into the directory: this run's step 4 would be pruned as the
    oldest and step 5 kept, so saving it stops with one line and leaves the directory as it was."""
    directory = str(tmp_path / "ckpt")
    store = _saved(directory, [3, 5])
    with pytest.raises(ConfigError) as error:
        store.save({"w": np.zeros([2], np.float32), "global_step": np.int64(4)}, 4)
    assert str(error.value) == (f"checkpoint directory {directory} holds step-5, newer than step 4 this run is saving: "
                                "another run writes into it; give each run its own --ckpt_dir")
    assert sorted(os.listdir(directory)) == ["checkpoint", "step-3", "step-5"]
    assert tf.train.load_variable(store.latest(), "global_step") == 5
    store.save({"w": np.zeros([2], np.float32), "global_step": np.int64(5)}, 5)     # the same step: replaced
    assert tf.train.load_variable(store.latest(), "w").tolist() == [0.0, 0.0]


def test_an_unreadable_checkpoint_says_which_and_what_to_delete(tmp_path):
    directory = str(tmp_path / "ckpt")
    _saved(directory, [3])
    data = [f for f in os.listdir(os.path.join(directory, "step-3")) if f.startswith("model.data")]
    os.remove(os.path.join(directory, "step-3", data[0]))
    with pytest.raises(ConfigError, match=rf"^checkpoint {directory}/step-3/model cannot be read \(.+\); delete "
                                          rf"{directory}/step-3 to go on from the checkpoint before it$"):
        CheckpointStore.load(CheckpointStore(directory).latest())
