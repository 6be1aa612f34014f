"""ptf.fit against single-device tf_keras fit, run eagerly in the same job (real ranks)."""
import json
import os
import tempfile

import numpy as np
import pytest

from tests import launch, reference


@pytest.mark.parametrize("case,strategy,ranks", [("mlp", "hybrid", 2), ("mlp", "ps", 3),
                                                 ("wide_deep", "hybrid", 2), ("wide_deep", "allreduce", 3)])
def test_fit_equals_single_device_fit(case, strategy, ranks):
    out = tempfile.mkdtemp(prefix="ptf-fit-")
    proc = launch.run_ranks(1, ["tests/jobs/fit_job.py", f"--case={case}", f"--out={out}", f"--np={ranks}",
                                f"--strategy={strategy}", "--log_every=0"], launcher="python", timeout=300)
    assert proc.returncode == 0, launch.tail(proc)
    saved = np.load(os.path.join(out, f"{case}.npz"))
    tolerance = 1e-4 if case == "mlp" else 1e-5     # Adam: 1e-4
    names = [k[4:] for k in saved.files if k.startswith("got:")]
    assert names and sorted(names) == sorted(k[5:] for k in saved.files if k.startswith("want:"))
    for name in names:
        assert reference.relative_error(saved[f"got:{name}"], saved[f"want:{name}"]) <= tolerance, name
    # History as single-device fit's: the loss and every compiled metric, per epoch, over the
    # whole global batch (AUC from the ranks' summed confusion matrices)
    got, want = json.loads(str(saved["history"])), json.loads(str(saved["reference_history"]))
    assert sorted(got) == sorted(want) and len(want) > 1, (got, want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)


def test_an_argument_fit_does_not_take_yet_is_one_clear_error():
    import tf_keras
    import parallax_tf as ptf
    model = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(2,))])
    model.compile("sgd", "mse")
    with pytest.raises(ptf.ConfigError, match=r"ptf.fit does not take \['callbacks', 'validation_data'\] yet"):
        ptf.fit(model, np.ones((4, 2)), np.ones((4, 1)), callbacks=[tf_keras.callbacks.History()],
                validation_data=(np.ones((2, 2)), np.ones((2, 1))))
    with pytest.raises(ptf.ModelError, match="ptf.fit needs a compiled model"):
        ptf.fit(tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(2,))]), np.ones((4, 2)), np.ones((4, 1)))


def _history(argv) -> dict:
    proc = launch.run_ranks(1, ["tests/jobs/fit_resume_job.py", *argv, "--log_every=0"], launcher="python", timeout=180)
    assert proc.returncode == 0, launch.tail(proc)
    return json.loads(proc.stdout.split("history ", 1)[1])


def test_a_resumed_fit_reports_the_epochs_it_trained_as_an_uninterrupted_one():
    ckpt = tempfile.mkdtemp(prefix="ptf-fit-ckpt-")
    whole = _history(["3"])
    assert _history(["1", f"--ckpt_dir={ckpt}"])["epoch"] == [0]
    resumed = _history(["3", f"--ckpt_dir={ckpt}"])      # from the end of epoch 0 (step 7)
    assert resumed["epoch"] == [1, 2]
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(resumed[key], whole[key][1:], rtol=1e-6, err_msg=key)
