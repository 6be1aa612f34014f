"""One rank of tools/commit_cost.py: trains --model with disk checkpoints and in-memory commits
and, on rank 0, writes what each save cost to $PARALLAX_COST_OUT/<model>.json."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import parallax_tf as ptf  # noqa: E402  (before TensorFlow: with --np the ranks start here)
from absl import app, flags  # noqa: E402

from tools.shared import model_and_input  # noqa: E402  (defines --model)

FLAGS = flags.FLAGS


def main(argv):
    result = ptf.run(*model_and_input(FLAGS.model), log_every=0)
    if int(os.environ.get("HOROVOD_RANK", "0")) == 0:
        keys = ("checkpoint_ms", "checkpoint_bytes", "commit_ms", "commit_bytes")
        with open(os.path.join(os.environ["PARALLAX_COST_OUT"], f"{FLAGS.model}.json"), "w") as f:
            json.dump({k: result.extras.get(k) for k in keys}, f)


if __name__ == "__main__":
    app.run(main)
