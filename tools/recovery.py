"""Time to recover from a lost rank: the lm model on --ranks local ranks with --max_restarts 1;
a rank SIGKILLs itself at --kill_at, the launcher stops the others and starts the job again from
the latest checkpoint. Prints, from the death to the restarted job's first step: detection and
teardown (until the restarted rank's interpreter starts), imports, rendezvous, inspection,
plan and graph, session and restore, first step.

    python -m tools.recovery --runs 3
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

from absl import app, flags

flags.DEFINE_integer("runs", 3, "Runs; the median of each phase is printed.")
flags.DEFINE_integer("ranks", 3, "Local ranks (--np).")
flags.DEFINE_integer("kill_at", 20, "Step at which rank 1 dies (checkpoints every 10 steps).")
FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = [("detection, teardown, relaunch", "process", "killed"),
          ("imports", "run", "process"),
          ("rendezvous and servers", "rendezvous", "run"),
          ("inspection", "inspection", "rendezvous"),
          ("plan and graph rewrite", "graph", "inspection"),
          ("session, initialisation, restore", "session", "graph"),
          ("first step", "first_step", "session")]


def one_run() -> dict:
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as ckpt:
        env = dict(os.environ, PARALLAX_RECOVERY_OUT=out, PYTHONPATH=ROOT)
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "recovery_job.py"), "--np",
                               str(FLAGS.ranks), "--steps", str(FLAGS.kill_at + 10), "--ckpt_dir", ckpt,
                               "--ckpt_every", "10", "--max_restarts", "1", "--kill_at", str(FLAGS.kill_at)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"the job failed (status {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        with open(os.path.join(out, "marks.json")) as f:
            marks = json.load(f)
        with open(os.path.join(out, "killed_at")) as f:
            marks["killed"] = float(f.read())
    return marks


def main(argv):
    runs = [one_run() for _ in range(FLAGS.runs)]
    width = max(len(name) for name, _, _ in PHASES)
    print(f"{'phase':<{width}}  median s  (runs: {FLAGS.runs}, {FLAGS.ranks} ranks, lm, resumed at step "
          f"{runs[0]['start_step']})")
    for name, end, start in PHASES:
        seconds = [r[end] - r[start] for r in runs]
        print(f"{name:<{width}}  {statistics.median(seconds):8.2f}  ({', '.join(f'{s:.2f}' for s in seconds)})")
    total = [r["first_step"] - r["killed"] for r in runs]
    print(f"{'death to first step':<{width}}  {statistics.median(total):8.2f}  ({', '.join(f'{s:.2f}' for s in total)})")


if __name__ == "__main__":
    app.run(main)
