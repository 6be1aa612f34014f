"""Runs on every rank: trains each named case with parallax_tf and saves what this rank got.

usage: equivalence_job.py OUT_DIR STRATEGY CASE [CASE ...] [--flag=value ...]  (parallax_tf flags)
       equivalence_job.py --runs=JSON   runs one after another (tests/jobs/several_runs.py), each
                                        {"out", "strategy", "names", "flags"}"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import parallax_tf as ptf  # noqa: E402
from tests import cases  # noqa: E402
from tests.jobs import several_runs  # noqa: E402


def main(out_dir, strategy, names):
    for name in names:
        _, model, optimizer, extra = cases.CASE_BY_NAME[name]
        result = ptf.run(cases.build(model, optimizer), cases.input_fn_for(model), steps=cases.STEPS,
                         strategy=strategy, log_every=0, **extra)
        import horovod.tensorflow as hvd
        arrays = {f"var:{k}": v for k, v in result.variables.items()}
        layouts = {v.name: v.layout for v in result.plan.variables}
        np.savez(os.path.join(out_dir, f"{name}.rank{hvd.rank()}.npz"), losses=np.array(result.losses),
                 global_step=result.global_step, layouts=repr(layouts), route_bytes=json.dumps(result.bytes_per_step),
                 plan=result.plan.to_json(),
                 **arrays)


if __name__ == "__main__":
    runs, sys.argv = several_runs.take(sys.argv)
    if runs:
        for run in several_runs.each(runs):
            main(run["out"], run["strategy"], run["names"])
    else:
        main(sys.argv[1], sys.argv[2], [a for a in sys.argv[3:] if not a.startswith("--")])
