"""Where the first seconds of a run go: runs the demo's job (models.lm, 2 local ranks, hybrid,
60 steps) `--runs` times and prints the median of each phase, from the command's start to its
exit (rank 0's marks: parallax_tf.api records when each phase ended).

    python -m tools.startup --runs 3
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

flags.DEFINE_integer("runs", 3, "Runs of the job; the median of each phase is printed.")
flags.DEFINE_integer("ranks", 2, "Local ranks (--np).")
flags.DEFINE_integer("job_steps", 60, "Training steps of the job.")
FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (phase, the mark it ends at, the mark it starts at); "begin"/"end": the command's own
PHASES = [("launch (python, launcher, rank spawn)", "process", "begin"),   # "process": the rank script's first line
          ("imports (TensorFlow, Horovod, model)", "run", "process"),
          ("rendezvous and servers", "rendezvous", "run"),
          ("inspection (capture, timed step)", "inspection", "rendezvous"),
          ("plan, agreed by all ranks", "plan", "inspection"),
          ("graph rewrite", "graph", "plan"),
          ("session and initialisation", "session", "graph"),
          ("training", "training", "session"),
          ("results", "returned", "training"),
          ("teardown and exit", "end", "returned")]


def one_run() -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PARALLAX_STARTUP_OUT=out, PYTHONPATH=ROOT)
        begin = time.time()
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "startup_job.py"), "--np",
                               str(FLAGS.ranks), "--steps", str(FLAGS.job_steps)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        end = time.time()
        if proc.returncode != 0:
            raise SystemExit(f"the job failed (status {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        with open(os.path.join(out, "rank0.json")) as f:
            marks = json.load(f)
    return dict(marks, begin=begin, end=end)


def main(argv):
    runs = [one_run() for _ in range(FLAGS.runs)]
    width = max(len(name) for name, _, _ in PHASES)
    print(f"{'phase':<{width}}  median s  (runs: {FLAGS.runs}, {FLAGS.ranks} ranks, {FLAGS.job_steps} steps)")
    for name, end, start in PHASES:
        seconds = [r[end] - r[start] for r in runs]
        print(f"{name:<{width}}  {statistics.median(seconds):8.2f}  ({', '.join(f'{s:.2f}' for s in seconds)})")
    walls = [r["end"] - r["begin"] for r in runs]
    print(f"{'wall':<{width}}  {statistics.median(walls):8.2f}  ({', '.join(f'{s:.2f}' for s in walls)})")


if __name__ == "__main__":
    app.run(main)
