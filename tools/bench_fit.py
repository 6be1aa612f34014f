"""Examples/s of the Keras recommendation model (models.keras_recsys) three ways on the same
ranks, in one invocation: ptf.fit, the same model written as a model_fn (ptf.run), and
Horovod's Keras path. Each form runs --repeats times, alternating; an epoch's examples/s is
rows / its wall time on rank 0, from the second epoch on (the first holds start-up).

    python -m tools.bench_fit --np 2 --repeats 3
"""
import os
import re
import subprocess
import sys

import numpy as np
from absl import app, flags

flags.DEFINE_integer("np", 2, "Ranks.")
flags.DEFINE_integer("repeats", 3, "Runs of each form.")
flags.DEFINE_string("strategy", "hybrid", "parallax_tf strategy of the fit and model_fn forms.")
flags.DEFINE_integer("rows", 20000, "Training rows.")
flags.DEFINE_integer("batch", 256, "Global batch.")
FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORMS = ("fit", "model_fn", "horovod")


def run_form(form: str) -> list:
    """Examples/s of each epoch after the first."""
    job = ["-m", "tools.bench_fit_job", f"--form={form}", f"--bench_rows={FLAGS.rows}", f"--bench_batch={FLAGS.batch}"]
    if form == "horovod":
        command = [sys.executable, "-m", "horovod.runner.launch", "-np", str(FLAGS.np), "-H",
                   f"localhost:{FLAGS.np}", "--gloo", sys.executable, *job]
    else:
        command = [sys.executable, *job, f"--np={FLAGS.np}", f"--strategy={FLAGS.strategy}"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"))
    if proc.returncode != 0:
        sys.exit(f"{form} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    seconds = [float(s) for epoch, s in re.findall(r"epoch_s (\d+) ([\d.]+)", proc.stdout) if int(epoch) > 0]
    return [FLAGS.rows / s for s in seconds]


def main(argv):
    rates = {form: [] for form in FORMS}
    for _ in range(FLAGS.repeats):
        for form in FORMS:
            rates[form].extend(run_form(form))
    print(f"keras_recsys, {FLAGS.np} ranks, global batch {FLAGS.batch}, {FLAGS.rows} rows; examples/s per epoch "
          f"after the first, {FLAGS.repeats} runs each")
    print("| form | examples/s (median) | min - max | vs Horovod Keras |")
    print("|---|---|---|---|")
    horovod = np.median(rates["horovod"])
    for form in FORMS:
        values = rates[form]
        print(f"| {form} | {np.median(values):,.0f} | {min(values):,.0f} - {max(values):,.0f} | "
              f"{np.median(values) / horovod:.2f}x |")


if __name__ == "__main__":
    app.run(main)
