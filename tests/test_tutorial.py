"""A TF1 tutorial as a new user ports it (tests/jobs/tutorial_job.py: the README's module-level
form, tf.compat.v1.layers, tf.data inside model_fn, a metric) and what the command line shows."""
import glob
import json
import os
import re
import tempfile

import numpy as np
import pytest
import tensorflow as tf

import parallax_tf as ptf
from tests import launch
from tests.test_surface import _run

JOB = "tests/jobs/tutorial_job.py"


def _result(stdout: str) -> dict:
    return json.loads(re.search(r"^result (.*)$", stdout, re.M).group(1))


def test_the_tutorial_on_two_ranks_reports_what_the_job_did():
    logdir = tempfile.mkdtemp(prefix="ptf-tutorial-")
    proc = _run([JOB, "--np", "2", "--steps", "20", "--log_every", "10", "--logdir", logdir],
                env={"TUTORIAL_STEPS": "30"})
    assert proc.returncode == 0, launch.tail(proc)
    # the script's run(steps=30) wins over --steps 20, and says so once
    assert proc.stderr.count("parallax_tf: note: run(steps=30) overrides --steps=20 from the command line") == 1
    got = _result(proc.stdout)
    assert got["steps"] == 30
    # examples from the batch each step read from tf.data: 64 per rank
    assert got["examples_per_step"] == 128
    assert got["examples_per_s"] == pytest.approx(128 * 30 / sum_of_step_times(proc.stdout, got), rel=0.5)
    # metrics are the mean over ranks: rank 0 reports 0, rank 1 reports 1
    assert got["metrics"]["rank"] == [0.5] * 30
    assert len(got["metrics"]["accuracy"]) == 30 and all(0 <= a <= 1 for a in got["metrics"]["accuracy"])
    progress = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["10/30", "20/30", "30/30"]
    assert all(" accuracy " in line and " rank 0.5000 " in line and "bytes/step/rank allreduce=" in line
               for line in progress), progress
    done = [line for line in proc.stdout.splitlines() if line.startswith("done: ")]
    assert len(done) == 1
    # the same loss as the last progress line: the mean over ranks, labelled
    assert f"final loss (mean over ranks) {got['mean_losses'][-1]:.4f}" in done[0]
    assert progress[-1].split()[3] == f"{got['mean_losses'][-1]:.4f}"
    assert f"wrote TensorBoard events in {logdir} (view: tensorboard --logdir {logdir})" in done[0]
    # tf.compat.v1.layers' deprecation warning: once per call line for the job (whichever rank says
    # it first), not once per rank
    warnings = [re.search(r"tutorial_job\.py:(\d+): UserWarning", line).group(1)
                for line in proc.stderr.splitlines() if "`tf.layers.dense` is deprecated" in line]
    dense_lines = [str(n) for n, line in enumerate(open(JOB), 1) if "tf.compat.v1.layers.dense(" in line]
    assert sorted(warnings) == dense_lines and len(dense_lines) == 2, proc.stderr
    tags = {value.tag for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
            for event in tf.compat.v1.train.summary_iterator(path) for value in event.summary.value}
    assert {"loss", "metrics/accuracy", "metrics/rank", "examples_per_second"} <= tags


@pytest.mark.parametrize("switch", ["disable_eager_execution", "disable_v2_behavior"])
def test_the_tutorial_in_one_process_after_its_first_line_switches_to_graph_mode(switch):
    proc = _run([JOB, "--steps", "5", "--log_every", "0"], env={"TUTORIAL_STEPS": "5", "TUTORIAL_DISABLE": switch})
    assert proc.returncode == 0, launch.tail(proc)
    got = _result(proc.stdout)
    assert got["steps"] == 5 and got["examples_per_step"] == 64
    assert all(np.isfinite(got["mean_losses"])) and len(got["mean_losses"]) == 5


def sum_of_step_times(stdout: str, got: dict) -> float:
    """The job's training time, from the summary line (examples/s is examples over it)."""
    seconds = float(re.search(r"^done: \d+ steps \(global step \d+\) in ([\d.]+)s", stdout, re.M).group(1))
    return max(seconds, 1e-3)


def test_plan_only_on_the_command_line_prints_the_plan_and_ends_the_program():
    proc = _run([JOB, "--plan_only", "--np", "2"])
    assert proc.returncode == 0, launch.tail(proc)
    assert proc.stdout.splitlines()[0].split()[:3] == ["variable", "shape", "MB"]
    assert "why:" in proc.stdout and "after run" not in proc.stdout and "plan only" not in proc.stdout


def test_plan_only_from_python_returns_a_result_that_says_so():
    def model_fn():
        x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="x")
        w = tf.compat.v1.get_variable("w", [2, 1])
        return ptf.Model(loss=tf.reduce_mean(tf.matmul(x, w)), optimizer=tf.compat.v1.train.AdamOptimizer(0.1))
    result = ptf.run(model_fn, lambda ctx: {"x": np.ones([2, 2], np.float32)}, plan_only=True, np=2)
    assert result.plan_only and result.variables == {} and result.losses == []
    assert [v.name for v in result.plan.variables] == ["w"] and result.plan.num_ranks == 2


def test_tensorboard_is_installed_by_the_set_up():
    proc = _run(["-c", "import tensorboard, sys; print(tensorboard.__version__)"])
    assert proc.returncode == 0 and proc.stdout.strip(), launch.tail(proc)
