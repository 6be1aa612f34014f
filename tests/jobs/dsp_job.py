"""Runs on every rank: trains each named DSP test model (tests/dsp_models.py) and saves what this
rank got into OUT/<name>.rank<r>.npz (variables, losses, global step, the plan).

usage: dsp_job.py OUT NAME [NAME ...] [--parallax_tf flags] [--die=RANK:BATCH]
       dsp_job.py --runs=JSON      runs one after another (tests/jobs/several_runs.py), each
                                   {"out", "names", "flags", "steps"}
--die=RANK:BATCH: rank RANK kills itself (SIGKILL) once stage 0 has read batch BATCH, once (a
restarted job goes on: OUT/died says it happened)."""
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import parallax_tf as ptf  # noqa: E402
from tests import dsp_models  # noqa: E402
from tests.jobs import several_runs  # noqa: E402


def _rank() -> int:
    return int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))


def _die_later(stamp: str, died: str) -> None:
    while not os.path.exists(stamp):
        time.sleep(0.02)
    open(died, "w").close()
    os.kill(os.getpid(), 9)


def main(out, names, die, steps=None):
    stamp, died = os.path.join(out, "stamp"), os.path.join(out, "died")
    if die and _rank() == die[0] and not os.path.exists(died):
        threading.Thread(target=_die_later, args=(stamp, died), daemon=True).start()
    steps = steps or int(os.environ.get("DSP_JOB_STEPS", dsp_models.BATCHES))
    for name in names:
        model_fn, inner, _ = dsp_models.MODELS[name]

        def input_fn(ctx, inner=inner):
            if die and ctx.step == die[1] and not os.path.exists(died):
                open(stamp, "w").close()
            return inner(ctx)
        result = ptf.run(model_fn, input_fn, steps=steps, strategy="dsp", log_every=0)
        np.savez(os.path.join(out, f"{name}.rank{_rank()}.npz"), losses=np.array(result.losses),
                 global_step=result.global_step, start_step=result.start_step, plan=result.plan.to_json(),
                 **{f"var:{k}": v for k, v in result.variables.items()})


if __name__ == "__main__":
    runs, sys.argv = several_runs.take(sys.argv)
    if runs:
        for run in several_runs.each(runs):
            main(run["out"], run["names"], None, run["steps"])
        sys.exit(0)
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    dies = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--die=")]
    sys.argv = [sys.argv[0]] + [a for a in sys.argv[1:] if a.startswith("--") and not a.startswith("--die=")]
    main(args[0], args[1:], tuple(int(x) for x in dies[0].split(":")) if dies else None)
