"""What a user sees on the command line: a quiet demo with rank 0's lines as they are, one line
and exit status 2 for an error they caused (the traceback with --verbose), and the self-check."""
import json
import os
import re
import subprocess
import tempfile

import pytest

from tests import launch

# what TensorFlow, absl, oneDNN, gRPC and Horovod print, and Horovod's own output prefixes
NOISE = re.compile(r"absl::InitializeLog|oneDNN|cpu_feature_guard|port\.cc|^[IWEF]\d{4} |rebuild TensorFlow|"
                   r"<stdout>|<stderr>|^\[\d+\]|^\[rank |^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWE] ")


def _run(argv, env=None, timeout=240):
    """A command as a user runs it: no TF_CPP_MIN_LOG_LEVEL, no launcher of the tests'."""
    full = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    full.update(PYTHONPATH=launch.ROOT, **(env or {}))
    return subprocess.run([launch.PYTHON, *argv], cwd=launch.ROOT, env=full, capture_output=True, text=True,
                          timeout=timeout, start_new_session=True)


def test_the_demo_prints_rank_0s_lines_and_nothing_else():
    proc = _run(["-m", "models.lm", "--np", "2", "--strategy", "hybrid", "--steps", "6", "--log_every", "3"])
    assert proc.returncode == 0, launch.tail(proc)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert [line for line in lines if NOISE.search(line)] == []
    assert lines[0].split()[:3] == ["variable", "shape", "MB"]
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["3/6", "6/6"]
    assert sum(line.startswith("done: 6 steps (global step 6)") for line in lines) == 1
    assert proc.stderr == ""
    # one final loss: the model's own line gives the summary's (the mean over ranks)
    final = re.search(r"final loss \(mean over ranks\) ([\d.]+)", proc.stdout).group(1)
    assert re.search(r"^lm: first loss [\d.]+ last loss ([\d.]+)$", proc.stdout, re.M).group(1) == final


USER_ERRORS = {
    "config": (["-m", "models.lm", "--np", "0"], "--np must be at least 1, got 0"),
    "config_ranks": (["-m", "models.lm", "--np", "2", "--steps", "-1"], "--steps must be >= 0, got -1"),
    "input_ranks": (["tests/jobs/bad_input_job.py", "--case=missing_placeholder", "--np=2"],
                    "input_fn did not provide placeholder(s) ['labels']; it returned keys ['ids']"),
    "hosts_without_np": (["-m", "models.lm", "--host_slots", "a:2"], "--host_slots=a:2 needs --np"),
    "too_few_slots": (["-m", "models.lm", "--np", "4", "--host_slots", "localhost:2"],
                      "--np=4 but --host_slots=localhost:2 has 2 slots"),
    "unreachable_host": (["-m", "models.lm", "--np", "2", "--host_slots", "nosuchhost.invalid:2"],
                         "ssh cannot reach nosuchhost.invalid without a password"),
    "model": (["tests/jobs/bad_input_job.py", "--case=sign_of_sparse_gradient", "--steps=2"],
              "gradient transform op 'Sign' (Sign) changes the rows of sparse PS variable 'emb'"),
    # a misspelled flag, in the README's module-level form and under absl's app.run on 2 ranks
    "misspelled_flag": (["tests/jobs/tutorial_job.py", "--stratgy", "ps"],
                        "Unknown command line flag 'stratgy'. Did you mean: strategy ?"),
    "misspelled_flag_ranks": (["-m", "models.lm", "--np", "2", "--log_evry", "5"],
                              "Unknown command line flag 'log_evry'. Did you mean: log_every ?"),
    "bad_flag_value": (["-m", "models.lm", "--strategy", "hybird"], "flag --strategy=hybird: value should be one of"),
    "wrong_batch_shape": (["tests/jobs/bad_input_job.py", "--case=wrong_shape", "--steps=2"],
                          "input_fn(ctx) at rank 0, step 0 returned 'ids' with shape (4, 2), but placeholder 'ids' "
                          "takes shape (None, 3)"),
    "never_calls_run": (["tests/jobs/keras_fit_job.py", "--np", "2"],
                        "keras_fit_job.py ended without calling parallax_tf.run, so each of its ranks ran it alone"),
}


@pytest.mark.parametrize("case", sorted(USER_ERRORS))
def test_a_user_error_ends_with_one_line_and_status_2(case):
    argv, message = USER_ERRORS[case]
    proc = _run(argv)
    assert proc.returncode == 2, launch.tail(proc)
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(f"parallax_tf: error: {message}"), \
        launch.tail(proc)
    assert "Traceback" not in proc.stdout


@pytest.mark.parametrize("how", ["--verbose", "PARALLAX_TRACEBACK=1"])
def test_verbose_shows_the_traceback_above_the_line(how):
    argv, env = (["-m", "models.lm", "--np", "0", "--verbose"], None) if how == "--verbose" else \
        (["-m", "models.lm", "--np", "0"], {"PARALLAX_TRACEBACK": "1"})
    proc = _run(argv, env)
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert "Traceback (most recent call last):" in lines
    assert "parallax_tf.errors.ConfigError: --np must be at least 1, got 0" in lines
    assert lines[-1] == "parallax_tf: error: --np must be at least 1, got 0"


def test_check_passes_here_and_names_what_is_missing():
    proc = _run(["-m", "parallax_tf", "check"])
    assert proc.returncode == 0, launch.tail(proc)
    lines = proc.stdout.splitlines()
    assert lines[-1] == "ok" and proc.stderr == ""
    found = {line.split("  ")[0]: line for line in lines}
    assert {"tensorflow", "horovod", "horovod controllers", "compiled ops", "bind shim", "gpus (tensorflow)",
            "two ranks"} <= set(found)
    assert "gloo" in found["horovod controllers"] and "allreduce and a PS round trip" in found["two ranks"]
    with tempfile.TemporaryDirectory() as empty:
        proc = _run(["-m", "parallax_tf", "check", f"--ops_dir={empty}", "--no_ranks"])
    assert proc.returncode == 1
    broken = [line for line in proc.stdout.splitlines() if line.startswith("broken: ")]
    assert len(broken) == 2 and proc.stdout.splitlines()[-2:] == broken
    assert broken[0].startswith(f"broken: the compiled ops are not built (no _parallax_ops*.so in {empty}): run "
                                "`make setup`")
    assert broken[1].startswith(f"broken: the bind shim is not built (no _bindshim*.so in {empty})")


def test_a_call_from_python_still_raises():
    code = ("import parallax_tf as ptf\ntry:\n    ptf.run(lambda ctx: None, np=0)\nexcept ptf.ConfigError as err:\n"
            "    print('raised', err)\n")
    proc = _run(["-c", code])
    assert proc.returncode == 0 and proc.stdout == "raised --np must be at least 1, got 0\n", launch.tail(proc)


def test_a_deprecated_call_in_the_users_own_code_is_said_once():
    """TensorFlow's notice about the user's own file shows, once although model_fn runs twice
    (inspection, rewrite); its notices about its own code and the toolkit's do not."""
    script = ("import sys\nimport numpy as np\nimport parallax_tf as ptf\nimport tensorflow as tf\n\n\n"
              "def model_fn():\n"
              "    x = tf.compat.v1.placeholder(tf.float32, [None], name='x')\n"
              "    w = tf.compat.v1.get_variable('w', [1], initializer=tf.compat.v1.constant_initializer(0.5, "
              "dtype=tf.float32))\n"
              "    return ptf.Model(loss=tf.reduce_mean(x * w), optimizer=tf.compat.v1.train.AdagradOptimizer(0.1))\n\n\n"
              "ptf.run(model_fn, lambda ctx: {'x': np.arange(4, dtype=np.float32)}, steps=2, log_every=0)\n"
              "print('done')\n")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "train.py")
        with open(path, "w") as f:
            f.write(script)
        proc = _run([path])
    assert proc.returncode == 0 and proc.stdout == "done\n", launch.tail(proc)
    notices = [line for line in proc.stderr.splitlines() if "is deprecated" in line]
    assert notices == [f"WARNING:tensorflow:From {path}:9: calling Constant.__init__ (from "
                       "tensorflow.python.ops.init_ops) with dtype is deprecated and will be removed in a future "
                       "version."], proc.stderr       # Adagrad's own use of it, inside TensorFlow, is not said


def test_a_nan_loss_ends_with_one_line_naming_the_step_and_status_3():
    """Rank 1 feeds NaN into the 4th step: the job says so once, as step 4 of the progress line."""
    out = tempfile.mkdtemp()
    proc = _run(["tests/jobs/train_case.py", "--case=sparse_only", f"--out={out}", "--steps=10", "--log_every=1",
                 "--nan_at_step=3", "--np=2"])
    assert proc.returncode == 3, launch.tail(proc)
    assert [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("step ")] == \
        ["1/10", "2/10", "3/10"]
    assert proc.stderr.splitlines() == [
        "parallax_tf: error: the loss (mean over ranks) is nan at step 4; training stopped before it could be "
        "checkpointed. Lower the learning rate or check the input, then restart from the last checkpoint"], \
        launch.tail(proc)


_RUN_SCRIPT = '''"""Trains w on x: the script's usage line."""
import numpy as np
import parallax_tf as ptf
import tensorflow as tf
from absl import app, flags

flags.DEFINE_integer("my_width", 3, "The script's own flag.")


def model_fn():
    x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
    w = tf.compat.v1.get_variable("w", [1])
    return ptf.Model(loss=tf.reduce_mean(x * w), optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))


def main(argv):
    ptf.run(model_fn, lambda ctx: {"x": np.ones(2, np.float32)}, steps=1, log_every=0)
    print("trained")


'''
_SCRIPT_ENDINGS = {
    "run": "main(None)\n",
    "app.run": "app.run(main)\n",
    "fit": ("import tf_keras\nmodel = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(2,))])\n"
            "model.compile(tf_keras.optimizers.legacy.SGD(0.1), 'mse')\n"
            "ptf.fit(model, np.ones((4, 2)), np.ones((4, 1)), batch_size=2, epochs=1)\nprint('trained')\n"),
}


@pytest.mark.parametrize("form, flag", [("run", "--help"), ("app.run", "--help"), ("app.run", "-h"),
                                        ("fit", "--help"), ("run", "--helpfull"), ("app.run", "--helpfull"),
                                        ("models.lm", "--help"), ("run", "--np 2 --help")])
def test_help_lists_the_flags_and_ends_with_status_0(form, flag):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "train.py")
        with open(path, "w") as f:
            f.write(_RUN_SCRIPT + _SCRIPT_ENDINGS.get(form, ""))
        proc = _run((["-m", "models.lm"] if form == "models.lm" else [path]) + flag.split())
    assert proc.returncode == 0 and proc.stderr == "", launch.tail(proc)
    out = proc.stdout
    assert "trained" not in out
    own = "  --lm_vocab: Vocabulary size." if form == "models.lm" else "  --my_width: The script's own flag."
    assert out.startswith("LSTM language model" if form == "models.lm" else "Trains w on x: the script's usage line.")
    for listed in (own, "\nparallax_tf.flags:\n", "  --np: Ranks to launch", "  --strategy: <hybrid|ps|allreduce|",
                   "\nparallax_tf.strategy:\n", "  --slim_core: slim_dp: fraction"):
        assert listed in out, listed
    if flag == "--helpfull":          # every module's flags, absl's own too
        assert "\nabsl.logging:\n" in out and "  -v,--verbosity: Logging verbosity level." in out
        assert "Try --helpfull" not in out
    else:
        assert "absl.logging" not in out and out.endswith("\nTry --helpfull to get a list of all flags.\n")


_ARGPARSE_SCRIPT = '''import argparse
import sys

import numpy as np
import parallax_tf as ptf
import tensorflow as tf
from absl import app

parser = argparse.ArgumentParser()
parser.add_argument("--my_width", type=int, default=1)
args, _ = parser.parse_known_args()


def model_fn():
    x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
    w = tf.compat.v1.get_variable("w", [args.my_width])
    return ptf.Model(loss=tf.reduce_mean(x[:, None] * w), optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))


def main(argv):
    result = ptf.run(model_fn, lambda ctx: {"x": np.ones(2, np.float32)}, steps=1, log_every=0)
    print(f"rank {result.rank}: my_width {args.my_width} w {result.variables['w'].shape} positional {argv[1:]}")


app.run(main) if sys.argv[-1] == "app.run" else main([None])
'''


@pytest.mark.parametrize("form", ["argparse", "app.run"])
def test_the_scripts_own_arguments_after_the_separator_reach_its_parsers(form):
    """argparse's parse_known_args reads what follows `--` (it would take it all as positional);
    absl's app.run still hands main the arguments after `--`."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "train.py")
        with open(path, "w") as f:
            f.write(_ARGPARSE_SCRIPT)
        tail = ["app.run"] if form == "app.run" else []
        proc = _run([path, "--np", "2", "--strategy", "allreduce", "--", "--my_width", "3", *tail])
    assert proc.returncode == 0, launch.tail(proc)
    said = sorted(line for line in proc.stdout.splitlines() if ": my_width" in line)
    positional = str(["--my_width", "3", *tail] if form == "app.run" else [])
    assert said == [f"[rank 1] rank 1: my_width 3 w (3,) positional {positional}",
                    f"rank 0: my_width 3 w (3,) positional {positional}"], proc.stdout


_RANK_SCRIPT = '''import json
import os
import sys

import numpy as np
import parallax_tf as ptf
import tensorflow as tf

before = [ptf.rank(), ptf.size()]


def model_fn():
    x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
    w = tf.compat.v1.get_variable("w", [1])
    return ptf.Model(loss=tf.reduce_mean(x * w), optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))


result = ptf.run(model_fn, lambda ctx: {"x": np.ones(2, np.float32)}, steps=1, log_every=0)
with open(os.path.join(sys.argv[1], f"rank{result.rank}.json"), "w") as out:
    json.dump({"before": before, "result": [result.rank, result.size], "after": [ptf.rank(), ptf.size()]}, out)
'''


@pytest.mark.parametrize("ranks", [1, 2])
def test_rank_and_size_say_which_rank_of_the_job_a_process_is(ranks):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "train.py")
        with open(path, "w") as f:
            f.write(_RANK_SCRIPT)
        proc = _run([path, folder, "--np", str(ranks)])
        assert proc.returncode == 0, launch.tail(proc)
        got = {}
        for rank in range(ranks):
            with open(os.path.join(folder, f"rank{rank}.json")) as f:
                got[rank] = json.load(f)
    assert got == {r: {"before": [r, ranks], "result": [r, ranks], "after": [r, ranks]} for r in range(ranks)}


def test_rank_and_size_before_the_job_are_the_launchers():
    code = "import parallax_tf as ptf\nprint(ptf.rank(), ptf.size())\n"
    for env, want in (({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3"}, "2 3\n"),
                      ({"PMI_RANK": "1", "PMI_SIZE": "4"}, "1 4\n"), ({}, "0 1\n")):
        proc = _run(["-c", code], env)
        assert proc.returncode == 0 and proc.stdout == want, launch.tail(proc)
