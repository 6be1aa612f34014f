"""One rank of tools/recovery.py's run: the lm model with checkpoints; rank --victim SIGKILLs itself
when it reaches --kill_at, once (a marker file in $PARALLAX_RECOVERY_OUT). The restarted job's
rank 0 writes its marks (phases, first step) to $PARALLAX_RECOVERY_OUT/marks.json."""
import time

STARTED = time.time()     # before any import: the rank's interpreter has just started

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import parallax_tf as ptf  # noqa: E402  (before TensorFlow: with --np the ranks start here)
from absl import app, flags  # noqa: E402

from models import lm  # noqa: E402
from parallax_tf.runtime.hooks import Hook  # noqa: E402

flags.DEFINE_integer("kill_at", 20, "Step at which the victim kills itself.")
flags.DEFINE_integer("victim", 1, "The rank that dies.")
FLAGS = flags.FLAGS


class FirstStep(Hook):
    def __init__(self):
        self.at = None

    def after_step(self, step, loss, stats):
        self.at = self.at or time.time()


def main(argv):
    out = os.environ["PARALLAX_RECOVERY_OUT"]
    marker = os.path.join(out, "killed_at")
    restarted = os.path.exists(marker)
    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    inner = lm.make_input_fn()

    def input_fn(ctx):
        if not restarted and rank == FLAGS.victim and ctx.step == FLAGS.kill_at:
            with open(marker, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), 9)
        return inner(ctx)
    first = FirstStep()
    result = ptf.run(lm.make_model_fn(), input_fn, hooks=[first], log_every=0)
    if rank == 0 and restarted:
        with open(os.path.join(out, "marks.json"), "w") as f:
            json.dump(dict(result.extras["phases"], process=STARTED, first_step=first.at,
                           start_step=result.start_step), f)


if __name__ == "__main__":
    app.run(main)
