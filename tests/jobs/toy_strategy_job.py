"""Runs on every rank: registers tests/toy_strategy.py's strategies and trains each named case
with the one named, saving what this rank got (as equivalence_job.py does).

usage: toy_strategy_job.py OUT_DIR STRATEGY CASE [CASE ...]"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import parallax_tf as ptf  # noqa: E402
from tests import cases, toy_strategy  # noqa: E402


def main(out_dir, strategy, names):
    toy_strategy.register()
    for name in names:
        _, model, optimizer, extra = cases.CASE_BY_NAME[name]
        result = ptf.run(cases.build(model, optimizer), cases.input_fn_for(model), steps=cases.STEPS,
                         strategy=strategy, log_every=0, **extra)
        import horovod.tensorflow as hvd
        np.savez(os.path.join(out_dir, f"{name}.rank{hvd.rank()}.npz"), global_step=result.global_step,
                 table=result.plan.table(), **{f"var:{k}": v for k, v in result.variables.items()})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
