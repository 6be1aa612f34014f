"""What a disk checkpoint and an in-memory commit cost rank 0 (reading the state and writing it),
for lm and cnn on --ranks local ranks, every 5 steps of 30 (the final save left out).

    python -m tools.commit_cost --ranks 4
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

from absl import app, flags

flags.DEFINE_integer("ranks", 4, "Local ranks (--np).")
flags.DEFINE_list("models", ["lm", "cnn"], "Reference models.")
FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(model: str) -> dict:
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as ckpt:
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "commit_cost_job.py"), f"--model={model}",
                               f"--np={FLAGS.ranks}", "--steps=30", f"--ckpt_dir={ckpt}", "--ckpt_every=5",
                               "--commit_every=5", "--max_restarts=0"], cwd=ROOT, capture_output=True, text=True,
                              timeout=900, env=dict(os.environ, PARALLAX_COST_OUT=out, PYTHONPATH=ROOT))
        if proc.returncode != 0:
            raise SystemExit(f"{model} failed (status {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        with open(os.path.join(out, f"{model}.json")) as f:
            return json.load(f)


def main(argv):
    print(f"{'model':<6} {'what':<11} {'MB':>7} {'median ms':>10}  (each save, {FLAGS.ranks} ranks)")
    for model in FLAGS.models:
        got = measure(model)
        for what in ("checkpoint", "commit"):
            times = got[f"{what}_ms"][:-1] if what == "checkpoint" else got[f"{what}_ms"]   # not the final save
            print(f"{model:<6} {what:<11} {got[f'{what}_bytes'] / 2**20:7.2f} {statistics.median(times):10.1f}  "
                  f"({', '.join(f'{t:.1f}' for t in times)})")


if __name__ == "__main__":
    app.run(main)
