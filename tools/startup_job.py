"""One rank of tools/startup.py's run: the demo's job (models.lm, hybrid), then its start-up
marks written to $PARALLAX_STARTUP_OUT/rank<r>.json."""
import time

STARTED = time.time()     # before any import: the rank's interpreter has just started

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import parallax_tf as ptf  # noqa: E402  (before TensorFlow: with --np the ranks start here)
from absl import app  # noqa: E402

from models import lm  # noqa: E402


def main(argv):
    result = ptf.run(lm.make_model_fn(), lm.make_input_fn(), log_every=0)
    marks = dict(result.extras["phases"], process=STARTED, returned=time.time())
    with open(os.path.join(os.environ["PARALLAX_STARTUP_OUT"], f"rank{os.environ.get('HOROVOD_RANK', '0')}.json"),
              "w") as f:
        json.dump(marks, f)


if __name__ == "__main__":
    app.run(main)
