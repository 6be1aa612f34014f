"""Runs on every rank: trains models.criteo on a Criteo TSV file through tf.data and saves what rank 0 got.

usage: criteo_job.py OUT_DIR TSV STRATEGY: fixed tables, then dynamic ones (admitted after 2
occurrences) on the servers, then replicated on the ranks, in one job."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import parallax_tf as ptf  # noqa: E402
from models import criteo  # noqa: E402

SCALE, BATCH, STEPS = 1e-4, 4, 3      # BATCH lines per rank and step
DYNAMIC = {"admit_after": 2}


def main(out_dir, tsv, strategy):
    import horovod.tensorflow as hvd
    for name, dynamic, where in ((strategy, None, None), (f"{strategy}_dynamic", DYNAMIC, "servers"),
                                 (f"{strategy}_dynamic_replicated", DYNAMIC, "replicated")):
        result = ptf.run(criteo.make_model_fn(SCALE, files=[tsv], batch=BATCH, dynamic=dynamic), None, steps=STEPS,
                         strategy=strategy, log_every=0, dynamic_tables=where)
        if hvd.rank() == 0:
            np.savez(os.path.join(out_dir, f"{name}.npz"), **{f"var:{k}": v for k, v in result.variables.items()})
            with open(os.path.join(out_dir, f"{name}.plan.txt"), "w") as f:
                f.write(result.plan.table())


if __name__ == "__main__":
    main(*sys.argv[1:4])
