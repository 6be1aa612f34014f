"""ptf.fit against single-device tf_keras fit, run eagerly in the same job (real ranks)."""
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
    np.testing.assert_allclose(saved["losses"], saved["reference_losses"], rtol=1e-5)
