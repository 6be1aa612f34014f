"""TF2 training steps through ptf.run(train_step, dataset), against the same step run eagerly on
one device in the same job. --runs is a list of case:strategy; each rank saves, per run, the
trained values of the script's own variables (read from them after run), the per-step mean
losses and the reference's to --out/<case>.<strategy>.rank<r>.npz.

keras3_wide: a Keras 3 functional model (an Embedding and dense layers), Adam, a tf.function
  step, an uneven last batch (40 rows in batches of 16), sample weights.
keras3_metric: a Keras 3 Sequential MLP, SGD with momentum, a keras.metrics.BinaryAccuracy the
  step updates (read after run: its state over every rank), the step returning {"loss", "accuracy"}.
tf_keras_adagrad: a tf_keras model in eager mode (an Embedding and a Dense), tf_keras' Adagrad.
module: a tf.Module of plain tf.Variables, a Python function as the step, a hand-written update
  (assign_sub, and scatter_sub of the table's IndexedSlices).
guide_training_loop: Keras' "Writing a training loop from scratch": a training metric, a validation
  loop between epochs, one ptf.run per epoch.
structured_fit: Keras' "Structured data classification": a StringLookup in the dataset's map, an
  Embedding of its index, ptf.fit with EarlyStopping (stops after 2 of 4 epochs).
module_shard_reading: the module case, each rank reading its own elements (--shard_reading).
keras3_fit_mlp, keras3_fit_wide: ptf.fit of a compiled Keras 3 model ('adam'; an MLP with
  validation_split, a wide-and-deep with an Embedding and labels of shape (N,)) against model.fit.

--die_at_step with --ckpt_dir: rank --die_rank kills itself (SIGKILL) after that step, once (a
died_at stamp in --out), and the job restarts from the checkpoint."""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import parallax_tf as ptf  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

from tests.jobs import tf2_cases  # noqa: E402

flags.DEFINE_list("runs", ["module:hybrid"], "case:strategy, ...")
flags.DEFINE_string("out", None, "where each rank writes <case>.<strategy>.rank<r>.npz")
flags.DEFINE_integer("die_at_step", -1, "rank --die_rank kills itself after this step, once")
flags.DEFINE_integer("die_rank", 1, "which rank --die_at_step kills")
FLAGS = flags.FLAGS


class DieOnce(ptf.runtime.hooks.Hook):
    def __init__(self, stamp: str):
        self.stamp = stamp

    def after_step(self, step, loss, stats):
        if step == FLAGS.die_at_step and ptf.rank() == FLAGS.die_rank and not os.path.exists(self.stamp):
            with open(self.stamp, "w") as out:
                out.write("died")
            os.kill(os.getpid(), 9)


def main(argv):
    os.environ["PTF_TF2_OUT"] = FLAGS.out        # where a case writes files beside its outcome
    for run in FLAGS.runs:
        case, strategy = run.split(":")
        hooks = [DieOnce(os.path.join(FLAGS.out, "died_at"))] if FLAGS.die_at_step >= 0 else []
        got = tf2_cases.CASES[case](strategy, hooks)
        np.savez(os.path.join(FLAGS.out, f"{case}.{strategy}.rank{ptf.rank()}.npz"),
                 **{f"got:{i}": v for i, v in enumerate(got.weights)},
                 **{f"want:{i}": v for i, v in enumerate(got.reference)},
                 losses=np.array(got.losses), reference_losses=np.array(got.reference_losses),
                 extra=json.dumps(got.extra))


if __name__ == "__main__":
    app.run(main)
