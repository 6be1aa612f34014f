"""Trains one named test case with parallax_tf's own flags (--strategy, --steps, --ckpt_dir, ...)
and saves what this rank got into --out/<case>.rank<r>.npz. A rank can be made to misbehave."""
import json
import os
import sys
import threading
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import parallax_tf as ptf  # noqa: E402
from tests import cases  # noqa: E402
from tests.jobs import several_runs  # noqa: E402

flags.DEFINE_string("case", "mixed_sgd", "a name from tests/cases.py CASES")
flags.DEFINE_string("out", None, "directory for the per-rank results")
flags.DEFINE_integer("nan_at_step", -1, "rank 1 feeds NaN targets at this step (sparse_only case)")
flags.DEFINE_integer("die_at_step", -1, "rank --die_rank kills itself (SIGKILL) when rank --die_trigger_rank reaches "
                     "this step")
flags.DEFINE_integer("die_rank", 1, "which rank (global) --die_at_step kills")
flags.DEFINE_integer("die_trigger_rank", None, "whose step counts (its ctx.rank; default --die_rank): a rank that "
                     "reads no data (a Stanza FC node) dies when another rank reaches the step")
flags.DEFINE_integer("die_writing_checkpoint", -1, "rank 0 is killed (SIGKILL, once: a died_at stamp in --out) "
                     "while writing this step's checkpoint, after its files are written and before they are "
                     "put in place")
flags.DEFINE_string("lose_host", None, "every rank on this host (HOROVOD_HOSTNAME) kills itself at --lose_host_at_step, "
                    "once, and marks the host lost (--out/lost-HOST) for tests/jobs/discover_hosts.py")
flags.DEFINE_integer("lose_host_at_step", -1, "the step at which --lose_host is lost")
flags.DEFINE_string("runs", None, "runs made one after another in this job (tests/jobs/several_runs.py), each "
                    "{\"flags\": [this script's and parallax_tf's: --case, --out, --strategy, --ckpt_dir, ...]}")
flags.DEFINE_bool("die_once", False, "--die_at_step kills only if --out has no died_at stamp yet (a restarted job "
                  "goes on)")
FLAGS = flags.FLAGS


def _rank():
    return int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))


def _die_when_stamped(stamp: str) -> None:
    while not os.path.exists(stamp):
        time.sleep(0.02)
    open(stamp + ".dying", "w").close()       # the trigger rank waits for this before its step goes on
    os.kill(os.getpid(), 9)


def _wait_for_the_victim(stamp: str, timeout_s: float = 120) -> None:
    """The trigger rank's step starts only once the victim is dying, so the step it dies at is
    the one asked for, however slowly the victim's watching thread runs."""
    deadline = time.time() + timeout_s
    while not os.path.exists(stamp + ".dying"):
        if time.time() > deadline:
            raise RuntimeError(f"rank {FLAGS.die_rank} did not die within {timeout_s:.0f}s of {stamp}")
        time.sleep(0.01)


def _die_in_checkpoint(step: int, stamp: str) -> None:
    """CheckpointStore.save writes the checkpoint of `step` into its staging directory, and the
    process dies where that directory would be renamed into place."""
    from parallax_tf import checkpoint
    save = checkpoint.CheckpointStore.save

    def dying_rename(source, target):
        with open(stamp, "w") as out:
            out.write(repr(time.time()))
        os.kill(os.getpid(), 9)

    def dying_save(self, values, at_step):
        if at_step != step:
            return save(self, values, at_step)
        os.rename = dying_rename      # save renames once, its staging directory; nothing else runs after
        return save(self, values, at_step)
    checkpoint.CheckpointStore.save = dying_save


def main(argv):
    if not FLAGS.runs:
        return train()
    for _ in several_runs.each(json.loads(FLAGS.runs)):
        train()


def train():
    _, model, optimizer, extra = cases.CASE_BY_NAME[FLAGS.case]
    inner = cases.input_fn_for(model)
    stamp = os.path.join(FLAGS.out or ".", "died_at")
    trigger = FLAGS.die_rank if FLAGS.die_trigger_rank is None else FLAGS.die_trigger_rank
    once = FLAGS.die_once and os.path.exists(stamp)     # a restarted job: the death already happened
    if FLAGS.die_at_step >= 0 and _rank() == FLAGS.die_rank and trigger != FLAGS.die_rank and not once:
        threading.Thread(target=_die_when_stamped, args=(stamp,), daemon=True).start()
    if FLAGS.die_writing_checkpoint >= 0 and _rank() == 0 and not os.path.exists(stamp):
        _die_in_checkpoint(FLAGS.die_writing_checkpoint, stamp)

    lost = os.path.join(FLAGS.out or ".", f"lost-{FLAGS.lose_host}")
    on_lost_host = FLAGS.lose_host and os.environ.get("HOROVOD_HOSTNAME") == FLAGS.lose_host

    def input_fn(ctx):
        if on_lost_host and ctx.step == FLAGS.lose_host_at_step:
            with open(lost, "w") as out:
                out.write(repr(time.time()))
            os.kill(os.getpid(), 9)
        if ctx.rank == trigger and ctx.step == FLAGS.die_at_step and not once:
            with open(stamp, "w") as out:
                out.write(repr(time.time()))
            if _rank() == FLAGS.die_rank:
                os.kill(os.getpid(), 9)
            _wait_for_the_victim(stamp)
        feeds = inner(ctx)
        if ctx.rank == 1 and ctx.step == FLAGS.nan_at_step:
            feeds["y"] = np.full_like(feeds["y"], np.nan)
        return feeds
    result = ptf.run(cases.build(model, optimizer), input_fn if inner else None, **extra)
    if FLAGS.out:
        arrays = {f"var:{k}": v for k, v in result.variables.items()}
        np.savez(os.path.join(FLAGS.out, f"{FLAGS.case}.rank{_rank()}.npz"), losses=np.array(result.losses),
                 global_step=result.global_step, start_step=result.start_step,
                 checkpoint=str(result.checkpoint), bytes=np.array(result.bytes_per_step, dtype=object),
                 extras=repr(result.extras), histograms=repr(result.histograms), lost_ranks=result.lost_ranks,
                 routes=json.dumps({v.name: v.route for v in result.plan.variables}), **arrays)


if __name__ == "__main__":
    app.run(main)
