"""Checkpoints: plain-TF restore under single-device names, exact resume, another rank count."""
import json
import os
import tempfile

import numpy as np
import pytest
import tensorflow as tf

from tests import cases, launch, reference


def _train(size, case, out, *flags, launcher="horovodrun"):
    proc = launch.run_ranks(size, ["tests/jobs/train_case.py", f"--case={case}", f"--out={out}",
                                   "--log_every=0", *flags], launcher=launcher)
    assert proc.returncode == 0, launch.tail(proc)
    return [np.load(os.path.join(out, f"{case}.rank{r}.npz")) for r in range(size)]


def _assert_close(got, want, tolerance, what):
    for name, value in want.items():
        error = reference.relative_error(got[f"var:{name}"], value)
        assert error <= tolerance, f"{what}/{name}: relative error {error:.2e}"


@pytest.mark.parametrize("strategy", ["hybrid", "ps", "allreduce"])
def test_interrupted_and_resumed_run_matches_uninterrupted(strategy):
    ckpt, out = tempfile.mkdtemp(), tempfile.mkdtemp()
    first = _train(2, "mixed_adam", out, f"--strategy={strategy}", "--steps=3", f"--ckpt_dir={ckpt}", "--ckpt_every=3")
    assert int(first[0]["global_step"]) == 3 and sorted(os.listdir(ckpt)) == ["checkpoint", "step-3"]
    second = _train(2, "mixed_adam", out, f"--strategy={strategy}", "--steps=6", f"--ckpt_dir={ckpt}")
    assert [int(r["start_step"]) for r in second] == [3, 3]
    assert [int(r["global_step"]) for r in second] == [6, 6]
    assert len(second[0]["losses"]) == 3          # only the remaining steps ran
    _assert_close(second[0], reference.train_single_device("mixed", "adam", 2, steps=6), 1e-4, strategy)


def test_resumed_run_continues_the_learning_rate_schedule():
    """clip_decay: exponential decay on the model's own global step, clipped by global norm."""
    ckpt, out = tempfile.mkdtemp(), tempfile.mkdtemp()
    _train(2, "clip_decay_sgd", out, "--steps=3", f"--ckpt_dir={ckpt}", "--ckpt_every=3")
    reader = tf.train.load_checkpoint(os.path.join(ckpt, "step-3", "model"))
    names = reader.get_variable_to_shape_map()
    assert reader.get_tensor("global_step") == 3 and "parallax_global_step" not in names
    second = _train(3, "clip_decay_sgd", out, "--steps=6", f"--ckpt_dir={ckpt}")
    assert int(second[0]["start_step"]) == 3 and int(second[0]["global_step"]) == 6
    want = reference.train_single_device("clip_decay", "sgd", [2, 2, 2, 3, 3, 3], steps=6)
    _assert_close(second[0], want, 1e-5, "clip_decay resumed")


def test_keras_checkpoint_restores_into_the_single_device_keras_model():
    ckpt, out = tempfile.mkdtemp(), tempfile.mkdtemp()
    ranks = _train(2, "keras_bn", out, "--steps=3", f"--ckpt_dir={ckpt}", "--strategy=allreduce")
    graph = tf.Graph()
    with graph.as_default():
        cases.build("keras_bn", "sgd")()
        with tf.compat.v1.Session(graph=graph) as sess:
            tf.compat.v1.train.Saver().restore(sess, tf.train.latest_checkpoint(ckpt))
            assert sess.run(tf.compat.v1.train.get_global_step()) == 3
            variables = {v.op.name: sess.run(v) for v in tf.compat.v1.global_variables()}
    for name in ranks[0].files:
        if name.startswith("var:"):
            np.testing.assert_array_equal(variables[name[4:]], ranks[0][name])
    assert {"sequential/bn_mid/moving_mean", "sequential/bn_mid/moving_variance"} <= {n[4:] for n in ranks[0].files}


def test_resume_on_a_different_number_of_ranks():
    ckpt, out = tempfile.mkdtemp(), tempfile.mkdtemp()
    _train(2, "mixed_momentum", out, "--steps=3", f"--ckpt_dir={ckpt}", "--ckpt_every=1", "--ckpt_keep=2")
    assert sorted(os.listdir(ckpt)) == ["checkpoint", "step-2", "step-3"]     # only the last 2 kept
    third = _train(3, "mixed_momentum", out, "--steps=5", f"--ckpt_dir={ckpt}")
    want = reference.train_single_device("mixed", "momentum", [2, 2, 2, 3, 3], steps=5)
    _assert_close(third[0], want, 1e-5, "2 then 3 ranks")


def test_rank_held_shards_are_saved_whole_and_resume_on_another_number_of_ranks():
    """Strategy collective: each rank holds its rows of the table and of Adam's slots; the
    checkpoint has them whole, under single-device names, and 3 ranks resume 2 ranks' run."""
    ckpt, out = tempfile.mkdtemp(), tempfile.mkdtemp()
    first = _train(2, "mixed_adam", out, "--strategy=collective", "--steps=3", f"--ckpt_dir={ckpt}",
                   "--ckpt_every=3")
    assert json.loads(str(first[0]["routes"]))["emb"] == "alltoall"
    saved = dict(tf.train.list_variables(tf.train.latest_checkpoint(ckpt)))
    assert saved["emb"] == saved["emb/Adam"] == saved["emb/Adam_1"] == [20, 4]
    third = _train(3, "mixed_adam", out, "--strategy=collective", "--steps=6", f"--ckpt_dir={ckpt}")
    assert [int(r["start_step"]) for r in third] == [3, 3, 3]
    want = reference.train_single_device("mixed", "adam", [2, 2, 2, 3, 3, 3], steps=6)
    _assert_close(third[0], want, 1e-4, "collective, 2 then 3 ranks")
    for other in third[1:]:
        np.testing.assert_array_equal(other["var:emb"], third[0]["var:emb"])


@pytest.mark.parametrize("case", ["partitioned", "auto_mod", "mixed_adam"])
def test_plain_saver_restores_into_the_single_device_graph(case):
    ckpt, out = tempfile.mkdtemp(), tempfile.mkdtemp()
    ranks = _train(2, case, out, "--steps=3", f"--ckpt_dir={ckpt}", "--partitions=4")
    _, model, optimizer, _ = cases.CASE_BY_NAME[case]
    want = reference.train_single_device(model, optimizer, 2, steps=3, with_slots=True)
    graph = tf.Graph()
    with graph.as_default():
        built = cases.build(model, optimizer)()
        built.optimizer.minimize(built.loss)
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session(graph=graph) as sess:
            saver.restore(sess, tf.train.latest_checkpoint(ckpt))
            restored = reference._whole_values(sess)
            restored.update(reference._slot_values(sess, built.optimizer))
            if optimizer == "adam":
                beta1, _ = built.optimizer._get_beta_accumulators()
                assert sess.run(beta1) == pytest.approx(0.9 ** 4)
    assert set(restored) == set(want)
    tolerance = 1e-4 if optimizer == "adam" else 1e-5
    for name, value in want.items():      # model variables and every slot
        assert reference.relative_error(restored[name], value) <= tolerance, name
    for name in ranks[0].files:
        if name.startswith("var:"):
            np.testing.assert_array_equal(restored[name[4:]], ranks[0][name])


def test_an_initializable_iterator_continues_where_the_resumed_run_stopped():
    """The iterator is initialised afresh on resume and advanced past the steps already trained."""
    ckpt, out = tempfile.mkdtemp(), tempfile.mkdtemp()
    _train(2, "init_iter", out, "--steps=3", f"--ckpt_dir={ckpt}", "--ckpt_every=3")
    second = _train(2, "init_iter", out, "--steps=5", f"--ckpt_dir={ckpt}")
    assert [int(r["start_step"]) for r in second] == [3, 3] and int(second[0]["global_step"]) == 5
    _assert_close(second[0], reference.train_single_device("init_iter", "sgd", 2), 1e-5, "init_iter resumed")
