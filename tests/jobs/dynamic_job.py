"""Trains tests/dynamic_models.py on this job's ranks, once per run of --runs (each run's own
flags: parallax_tf's and --optimizer, --table (JSON options), --strings, --name), and saves what
this rank got into --out/<name>.rank<r>.npz."""
import json
import os
import sys

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import parallax_tf as ptf  # noqa: E402
from tests import dynamic_models  # noqa: E402
from tests.jobs import several_runs  # noqa: E402

flags.DEFINE_string("optimizer", "adagrad", "a name from tests/dynamic_models.py OPTIMIZERS")
flags.DEFINE_string("table", "{}", "DynamicEmbedding's options, as JSON")
flags.DEFINE_bool("strings", False, "string ids")
flags.DEFINE_bool("twice", False, "the table read by two lookups (tests/dynamic_models.py)")
flags.DEFINE_bool("mixed", False, "a second table whose law only standard ops compute (tests/dynamic_models.py)")
flags.DEFINE_string("name", "run", "the result file's name")
flags.DEFINE_string("out", None, "directory for the per-rank results")
flags.DEFINE_string("runs", None, "runs made one after another (tests/jobs/several_runs.py)")
flags.DEFINE_integer("die_at_step", -1, "rank --die_rank kills itself (SIGKILL) when it reaches this step, once (a "
                     "died_at stamp in --out)")
flags.DEFINE_integer("die_rank", 0, "which rank --die_at_step kills")
FLAGS = flags.FLAGS


def main(argv):
    for _ in several_runs.each(json.loads(FLAGS.runs) if FLAGS.runs else [{}]):
        train()


def train():
    stamp = os.path.join(FLAGS.out, "died_at")

    def input_fn(ctx):
        if ctx.rank == FLAGS.die_rank and ctx.step == FLAGS.die_at_step and not os.path.exists(stamp):
            open(stamp, "w").close()
            os.kill(os.getpid(), 9)
        feed = dynamic_models.batch(ctx.rank, ctx.step, FLAGS.strings)
        return feed
    model_fn = dynamic_models.model_fn(FLAGS.optimizer, FLAGS.strings, FLAGS.twice, FLAGS.mixed,
                                       **json.loads(FLAGS.table))
    result = ptf.run(model_fn, input_fn)
    arrays = {f"var:{k}": v for k, v in result.variables.items()}
    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    np.savez(os.path.join(FLAGS.out, f"{FLAGS.name}.rank{rank}.npz"), losses=np.array(result.losses),
             mean_losses=np.array(result.mean_losses), global_step=result.global_step,
             start_step=result.start_step, plan=result.plan.table(), checkpoint=str(result.checkpoint),
             extras=repr(result.extras), **arrays)


if __name__ == "__main__":
    app.run(main)
