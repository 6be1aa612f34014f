"""ptf.fit against single-device tf_keras fit, run eagerly in the same job (real ranks)."""
import csv
import functools
import json
import os
import tempfile

import numpy as np
import pytest

from tests import launch, reference

DEGENERATE_SLIM_DP = ["--slim_core=1", "--slim_explore=0", "--slim_period=1"]
# one job per rank count, each ptf.fit call a case on a strategy (tests/jobs/fit_job.py)
RUNS = {2: ["mlp:hybrid", "wide_deep:hybrid", "subclassed:hybrid", "two_heads:hybrid", "mlp:allreduce", "mlp:auto",
            "mlp:slim_dp", "guide_mnist_mlp:hybrid", "guide_mnist_cnn:hybrid", "guide_imdb:hybrid",
            "guide_structured:hybrid", "dynamic_wide:hybrid"],
        3: ["wide_deep:allreduce", "mlp:ps", "subclassed:hybrid", "cnn:stanza", "wide_deep:stanza",
            "dynamic_wide:auto"]}


@functools.lru_cache(maxsize=None)
def _job(ranks: int) -> str:
    """The 2-rank job starts as `python fit_job.py --np 2`, the 3-rank one under horovodrun as
    users start it (with its build probe)."""
    out = tempfile.mkdtemp(prefix="ptf-fit-")
    argv = ["tests/jobs/fit_job.py", f"--runs={','.join(RUNS[ranks])}", f"--out={out}", "--log_every=0",
            *DEGENERATE_SLIM_DP]
    proc = launch.run_ranks(1, argv + [f"--np={ranks}"], launcher="python", timeout=400) if ranks == 2 else \
        launch.run_ranks(ranks, argv, launcher="horovodrun_probed", timeout=400)
    assert proc.returncode == 0, launch.tail(proc)
    return out


@pytest.mark.parametrize("ranks,run", [(ranks, run) for ranks, runs in RUNS.items() for run in runs])
def test_fit_equals_single_device_fit(ranks, run):
    out = _job(ranks)
    case, strategy = run.split(":")
    tolerance = 1e-4 if case == "mlp" or case.startswith("guide_") else 1e-5     # Adam: 1e-4
    for rank in range(ranks):
        saved = np.load(os.path.join(out, f"{case}.{strategy}.rank{rank}.npz"))
        count = len([k for k in saved.files if k.startswith("got:")])
        assert count and count == len([k for k in saved.files if k.startswith("want:")])
        for i in range(count):      # history.model holds the trained weights on every rank
            assert reference.relative_error(saved[f"got:{i}"], saved[f"want:{i}"]) <= tolerance, (rank, i)
        # History as single-device fit's on every rank: the loss, every compiled metric and
        # val_*, per epoch, over the whole global batch (AUC from the ranks' summed state)
        got, want = json.loads(str(saved["history"])), json.loads(str(saved["reference_history"]))
        seen = (got.pop("seen", None), want.pop("seen", None))
        assert sorted(got) == sorted(["epoch", *want]) and any(k.startswith("val_") for k in want), (got, want)
        assert got["epoch"] == list(range(len(want["loss"])))
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
        if seen[1] is not None:     # the custom callback: on rank 0 only, with the epoch's weights
            assert seen[0] == ([] if rank else seen[0]) and (rank or np.allclose(seen[0], seen[1], rtol=1e-5, atol=1e-6))


def test_early_stopping_stops_every_rank_and_the_callbacks_wrote_their_files():
    """EarlyStopping on rank 0 ends all ranks after epoch 2 of 4, as it ends single-device fit;
    CSVLogger and ModelCheckpoint wrote the epochs' logs and the trained weights."""
    import tf_keras
    out = _job(2)
    for rank in range(2):
        got = json.loads(str(np.load(os.path.join(out, f"wide_deep.hybrid.rank{rank}.npz"))["history"]))
        assert got["epoch"] == [0, 1], got
    with open(os.path.join(out, "wide_deep.hybrid.csv")) as f:
        rows = list(csv.DictReader(f))
    history = json.loads(str(np.load(os.path.join(out, "wide_deep.hybrid.rank0.npz"))["history"]))
    assert [int(r["epoch"]) for r in rows] == [0, 1]
    np.testing.assert_allclose([float(r["val_auc"]) for r in rows], history["val_auc"], rtol=1e-6)
    model = tf_keras.models.clone_model(_wide_deep_shape())
    model.load_weights(os.path.join(out, "wide_deep.hybrid.weights.h5"))
    saved = np.load(os.path.join(out, "wide_deep.hybrid.rank0.npz"))
    for i, value in enumerate(model.get_weights()):
        np.testing.assert_allclose(value, saved[f"got:{i}"], rtol=1e-6)


def _wide_deep_shape():
    from tests.jobs import fit_job
    return fit_job.wide_deep_model()


def test_what_fit_cannot_serve_is_one_clear_error():
    import tf_keras
    import parallax_tf as ptf
    model = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(2,))])
    model.compile("sgd", "mse")
    x, y = np.ones((4, 2)), np.ones((4, 1))
    with pytest.raises(ptf.ConfigError, match="ptf.fit does not take validation_freq: ptf.fit validates after "
                                              "every epoch"):
        ptf.fit(model, x, y, validation_freq=2)
    with pytest.raises(ptf.ConfigError, match="ptf.fit cannot take the callback ReduceLROnPlateau: it changes the "
                                              "eager model's optimizer"):
        ptf.fit(model, x, y, callbacks=[tf_keras.callbacks.ReduceLROnPlateau()])

    class PerBatch(tf_keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass
    with pytest.raises(ptf.ConfigError, match=r"callback PerBatch: it acts on every training batch "
                                              r"\(on_train_batch_end\)"):
        ptf.fit(model, x, y, callbacks=[PerBatch()])
    with pytest.raises(ptf.ConfigError, match="steps_per_epoch is for a dataset input"):
        ptf.fit(model, x, y, steps_per_epoch=2)
    with pytest.raises(ptf.ConfigError, match=r"class_weight needs the keys 0 to 1; got \[0, 2\]"):
        ptf.fit(model, x, y, class_weight={0: 1.0, 2: 1.0})
    nadam = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(2,))])
    nadam.compile(tf_keras.optimizers.Nadam(), "mse")
    with pytest.raises(ptf.ConfigError, match="ptf.fit cannot train compile's new Keras Nadam exactly"):
        ptf.fit(nadam, x, y)
    with pytest.raises(ptf.ModelError, match="ptf.fit needs a compiled model"):
        ptf.fit(tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(2,))]), x, y)


def _history(argv, env=None) -> dict:
    proc = launch.run_ranks(1, ["tests/jobs/fit_resume_job.py", *argv, "--log_every=0"], launcher="python",
                            timeout=180, env=env)
    assert proc.returncode == 0, launch.tail(proc)
    return json.loads(proc.stdout.split("history ", 1)[1].splitlines()[0])


def test_a_resumed_or_restarted_fit_ends_as_an_uninterrupted_one():
    ckpt = tempfile.mkdtemp(prefix="ptf-fit-ckpt-")
    whole = _history(["3"])
    assert _history(["1", f"--ckpt_dir={ckpt}"])["epoch"] == [0]
    resumed = _history(["3", f"--ckpt_dir={ckpt}"])      # from the end of epoch 0 (step 7)
    assert resumed["epoch"] == [1, 2]
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(resumed[key], whole[key][1:], rtol=1e-6, err_msg=key)
    # a rank lost at the end of epoch 1 (after step 14's checkpoint): the launcher restarts the
    # job, which resumes at step 14 and ends as the uninterrupted fit
    ckpt = tempfile.mkdtemp(prefix="ptf-fit-restart-")
    stamp = os.path.join(ckpt, "died")
    restarted = _history(["3", "--np=2", f"--ckpt_dir={ckpt}", "--ckpt_every=7", "--max_restarts=1"],
                         env={"PARALLAX_TEST_DIE_AT_EPOCH": "1", "PARALLAX_TEST_STAMP": stamp})
    assert os.path.exists(stamp) and restarted["epoch"] == [2], restarted
    np.testing.assert_allclose(restarted["loss"], whole["loss"][2:], rtol=1e-5)
    for got, want in zip(restarted["weights"], whole["weights"]):
        np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("form", ["embedding", "dynamic"])
def test_the_keras_recommendation_model_learns_under_fit(form):
    """models/keras_recsys.py learns on 2 ranks, with Keras Embedding tables and with its user and
    item ids (spread over the int64 range) in dynamic tables."""
    proc = launch.run_ranks(1, ["-m", "models.keras_recsys", "--np=2", "--krec_epochs=2", "--krec_rows=4000",
                                "--krec_users=3000", "--krec_items=500", "--krec_batch=128", "--log_every=0",
                                f"--krec_dynamic={form == 'dynamic'}"], launcher="python", timeout=300)
    assert proc.returncode == 0, launch.tail(proc)
    epochs = [line.split() for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    val_auc = [float(words[words.index("val_auc") + 1]) for words in epochs]
    assert len(val_auc) == 2 and val_auc[1] > val_auc[0] and val_auc[1] > 0.7, proc.stdout


def test_plan_only_prints_the_fit_models_plan_and_ends():
    """--plan_only on a Keras fit script: the plan (Embedding tables on the PS route under
    hybrid, the dense layers on AllReduce), status 0, no epoch trained."""
    proc = launch.run_ranks(1, ["-m", "models.keras_recsys", "--np=2", "--plan_only", "--krec_rows=400"],
                            launcher="python", timeout=120)
    assert proc.returncode == 0, launch.tail(proc)
    routes = dict(line.split()[0::5][:2] for line in proc.stdout.splitlines() if "/embeddings " in line or
                  "/kernel " in line)
    assert routes["user_id_embedding/embeddings"] == "ps" and routes["dense/kernel"] == "allreduce", proc.stdout
    assert "strategy=hybrid ranks=2" in proc.stdout and "epoch " not in proc.stdout
