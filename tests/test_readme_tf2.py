"""The README's TensorFlow 2 script as printed, on 2 real ranks, against its single-device form
(the line it changed restored): the models they save hold the same weights."""
import os
import re
import subprocess
import sys

import numpy as np

from tests import launch

README = os.path.join(launch.ROOT, "README.md")
# what the README leaves to the reader: the data, and a seed so that both runs start alike
DATA = """import numpy as np
keras.utils.set_random_seed(0)
_rng = np.random.RandomState(1)
ids = _rng.randint(0, 10000, (600, 20))
labels = _rng.randint(0, 2, (600, 1)).astype("float32")
"""


def readme_script() -> str:
    text = open(README, encoding="utf-8").read()
    section = text[text.index("### TensorFlow 2 and Keras 3"):]
    start = section.index("```python\n") + len("```python\n")
    return section[start:section.index("```", start)]


def _write(path: str, script: str, saved: str) -> None:
    head, model_line, rest = script.partition("model = keras.Sequential")
    with open(path, "w") as f:
        f.write(head + DATA + model_line + rest.replace('"model.keras"', repr(saved)))


def _weights(saved: str) -> list:
    code = ("import sys, numpy as np, keras; m = keras.models.load_model(sys.argv[1]); "
            "np.savez(sys.argv[2], *m.get_weights())")
    subprocess.run([sys.executable, "-c", code, saved, saved + ".npz"], check=True, timeout=120,
                   capture_output=True)
    with np.load(saved + ".npz") as found:
        return [found[f"arr_{i}"] for i in range(len(found.files))]


def test_the_readme_tf2_script_trains_on_two_ranks_as_its_single_device_form(tmp_path):
    script = readme_script()
    changed = re.search(r"^(\s*)ptf\.run\(train_step, dataset\)\s+# was: (.+)$", script, re.M)
    assert changed, "the README's TF2 script no longer shows the line it changed"
    single = script.replace(changed.group(0), changed.group(1) + changed.group(2))
    distributed_py, single_py = str(tmp_path / "train.py"), str(tmp_path / "single.py")
    _write(distributed_py, script, str(tmp_path / "ranks.keras"))
    _write(single_py, single, str(tmp_path / "single.keras"))

    proc = launch.run_ranks(1, [distributed_py, "--np=2"], launcher="python", timeout=300)
    assert proc.returncode == 0, launch.tail(proc)
    assert "ranks=2" in proc.stdout + proc.stderr, launch.tail(proc)      # the plan's line: two ranks trained
    proc = subprocess.run([sys.executable, single_py], cwd=launch.ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=launch.ROOT))
    assert proc.returncode == 0, launch.tail(proc)

    got, want = _weights(str(tmp_path / "ranks.keras")), _weights(str(tmp_path / "single.keras"))
    assert len(got) == len(want) == 3           # the embedding, the dense kernel and bias
    for g, w in zip(got, want):                 # Adam: 1e-4
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
