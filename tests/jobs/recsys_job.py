"""Runs on every rank: trains a small models.recsys once per named run and saves what this rank got.

usage: recsys_job.py OUT_DIR RUN [RUN ...]   (RUN: a key of RUNS)"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import parallax_tf as ptf  # noqa: E402
from models import recsys  # noqa: E402

# a few rows per table: every table still has hot rows touched by both ranks in one step
SIZES = dict(user_buckets=40, item_buckets=20, buckets=10)
HIDDEN = (8, 4)
BATCH = 8
STEPS = 4
SEED = 0
# name -> ptf.run keyword arguments; "hybrid_p3": every sparse PS table in 3 shards (uneven rows)
RUNS = {
    "hybrid": dict(strategy="hybrid"),
    "allreduce": dict(strategy="allreduce"),
    "ps": dict(strategy="ps"),
    "auto": dict(strategy="auto"),
    "hybrid_p3": dict(strategy="hybrid", partitions=3),
}
# runs that also write a checkpoint, into OUT_DIR/ckpt-RUN (tests/test_export serves it)
CHECKPOINTED = ("hybrid_p3",)


def model_fn():
    return recsys.make_model_fn(hidden=HIDDEN, **SIZES)


def input_fn():
    return recsys.make_input_fn(batch=BATCH, seed=SEED, **SIZES)


def main(out_dir, names):
    import horovod.tensorflow as hvd
    for name in names:
        ckpt = dict(ckpt_dir=os.path.join(out_dir, f"ckpt-{name}")) if name in CHECKPOINTED else {}
        result = ptf.run(model_fn(), input_fn(), steps=STEPS, log_every=0, seed=SEED, **RUNS[name], **ckpt)
        arrays = {f"var:{k}": v for k, v in result.variables.items()}
        routes = {v.name: [v.route, v.partitions] for v in result.plan.variables}
        np.savez(os.path.join(out_dir, f"{name}.rank{hvd.rank()}.npz"), losses=np.array(result.losses),
                 global_step=result.global_step, routes=json.dumps(routes), **arrays)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
