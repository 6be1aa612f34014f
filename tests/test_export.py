"""Serving export: a checkpoint and the model's forward graph become a SavedModel that plain
TensorFlow (no parallax_tf) loads and whose predictions equal single-device TF's from the same
checkpoint (1e-6)."""
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import tensorflow as tf
from absl import flags

from parallax_tf import export
from parallax_tf.checkpoint import CheckpointStore
from parallax_tf.errors import ConfigError, ModelError
from parallax_tf.model import Model, RunContext
from tests import launch
from tests.serving import serve as _serve
from tests.jobs import recsys_job
from tests.test_recsys import job_output

def _single_device_predictions(model_fn, checkpoint: str, feeds: dict) -> dict:
    """Plain TF: model_fn's graph, every variable restored by a tf.compat.v1 Saver."""
    graph = tf.Graph()
    with graph.as_default():
        model = model_fn(RunContext(serving=True))
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.tables_initializer())
            saver.restore(sess, checkpoint)
            return sess.run(model.predictions, {graph.get_tensor_by_name(k + ":0"): v for k, v in feeds.items()})


def test_a_model_trained_on_two_ranks_is_exported_and_served_without_parallax_tf():
    """models.recsys (feature columns: vocabulary tables, hashed and crossed columns) trained on
    2 ranks with every PS table in 3 shards; exported on the command line, as a user would."""
    out = job_output()
    ckpt_dir = os.path.join(out, "ckpt-hybrid_p3")
    trained = np.load(os.path.join(out, "hybrid_p3.rank0.npz"))
    checkpoint = tf.train.latest_checkpoint(ckpt_dir)
    table = "deep/input_layer/user_id_embedding/embedding_weights"
    np.testing.assert_array_equal(tf.train.load_variable(checkpoint, table), trained[f"var:{table}"])

    export_dir = os.path.join(tempfile.mkdtemp(prefix="ptf-export-"), "1")
    proc = launch.run_ranks(1, ["-m", "parallax_tf", "export", "--model=tests.jobs.recsys_job:model_fn",
                                f"--ckpt_dir={ckpt_dir}", f"--export_dir={export_dir}"], launcher="none")
    assert proc.returncode == 0, launch.tail(proc)
    assert proc.stdout.strip().splitlines()[-1] == f"exported {export_dir}"

    batch = recsys_job.input_fn()(RunContext(rank=5, size=8, step=100))     # rows the run never saw
    feeds = {k: v for k, v in batch.items() if k != "label"}
    want = _single_device_predictions(recsys_job.model_fn(), checkpoint, feeds)["probability"]
    got = _serve(export_dir, feeds)
    assert list(got["imported"]) == [], "the served model needed parallax_tf"
    assert not any(op.startswith("Parallax") for op in got["ops"]), got["ops"]
    for key in ("tf2:probability", "v1:probability"):
        assert got[key].shape == want.shape == (recsys_job.BATCH,)
        np.testing.assert_allclose(got[key], want, rtol=0, atol=1e-6)
    assert 0.05 < want.min() and want.max() < 0.95 and want.std() > 1e-4     # a real model's varied answers


VOCABULARY = ["red", "green", "blue"]


def _small_model_fn(vocabulary_file: str, dropout_seen: list):
    """A partitioned table read through a vocabulary file's lookup table, and dropout that only
    a training graph applies."""
    def model_fn(ctx):
        words = tf.compat.v1.placeholder(tf.string, [None], name="words")
        scale = tf.compat.v1.placeholder(tf.float32, [None], name="scale")
        label = tf.compat.v1.placeholder(tf.float32, [None], name="label")
        table = tf.lookup.StaticHashTable(tf.lookup.TextFileInitializer(
            vocabulary_file, tf.string, tf.lookup.TextFileIndex.WHOLE_LINE, tf.int64,
            tf.lookup.TextFileIndex.LINE_NUMBER), default_value=0)
        emb = tf.compat.v1.get_variable("emb", [len(VOCABULARY), 2], partitioner=tf.compat.v1.fixed_size_partitioner(2))
        w = tf.compat.v1.get_variable("w", [2, 1])
        hidden = tf.nn.embedding_lookup(emb, table.lookup(words)) * scale[:, None]
        dropout_seen.append(not ctx.serving)
        if not ctx.serving:
            hidden = tf.nn.dropout(hidden, rate=0.5)
        score = tf.squeeze(tf.matmul(hidden, w), 1)
        loss = tf.reduce_mean(tf.square(score - label))
        return Model(loss=loss, optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1),
                     predictions={"score": score, "hidden": hidden})
    return model_fn


def _small_checkpoint(where: str) -> tuple:
    """A checkpoint as parallax_tf writes it: whole values under single-device names."""
    emb, w = np.arange(6, dtype=np.float32).reshape(3, 2) / 10, np.array([[1.0], [-2.0]], np.float32)
    CheckpointStore(os.path.join(where, "ckpt")).save({"emb": emb, "w": w, "global_step": np.int64(7)}, 7)
    return os.path.join(where, "ckpt"), emb, w


def test_a_partitioned_table_a_vocabulary_file_and_the_serving_graph(tmp_path):
    vocabulary_file = str(tmp_path / "vocabulary.txt")
    with open(vocabulary_file, "w") as f:
        f.write("\n".join(VOCABULARY) + "\n")
    built_for_training = []
    ckpt_dir, emb, w = _small_checkpoint(str(tmp_path))
    written = export.export_saved_model(_small_model_fn(vocabulary_file, built_for_training), ckpt_dir,
                                        str(tmp_path / "served"))
    assert written == str(tmp_path / "served") and built_for_training == [False]
    os.remove(vocabulary_file)                      # the SavedModel holds its own copy (an asset)
    assert os.listdir(tmp_path / "served" / "assets") == ["vocabulary.txt"]
    words, scale = np.array([b"blue", b"red", b"green"]), np.array([1.0, 2.0, 0.5], np.float32)
    served = tf.saved_model.load(str(tmp_path / "served")).signatures["serving_default"]
    assert sorted(served.structured_input_signature[1]) == ["scale", "words"]     # not the label
    got = served(words=tf.constant(words), scale=tf.constant(scale))
    hidden = emb[[2, 0, 1]] * scale[:, None]
    np.testing.assert_allclose(got["hidden"].numpy(), hidden, atol=1e-6)
    np.testing.assert_allclose(got["score"].numpy(), (hidden @ w)[:, 0], atol=1e-6)


def _tf_data_model_fn(ctx):
    features = tf.compat.v1.data.make_one_shot_iterator(tf.data.Dataset.from_tensors(tf.ones([4, 2]))).get_next()
    w = tf.compat.v1.get_variable("w", [2, 1])
    score = tf.matmul(features, w)
    return Model(loss=tf.reduce_mean(score), optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1),
                 predictions=score)


def _without_predictions(ctx):
    w = tf.compat.v1.get_variable("w", [2, 1])
    return Model(loss=tf.reduce_sum(w), optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1))


def _constant_predictions(ctx):
    x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="x")
    w = tf.compat.v1.get_variable("w", [2, 1])
    return Model(loss=tf.reduce_sum(tf.matmul(x, w)), optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1),
                 predictions=2.0 * x)


def _wider(ctx):
    x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
    w = tf.compat.v1.get_variable("w", [3, 1])
    return Model(loss=tf.reduce_sum(w), optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1),
                 predictions=tf.matmul(x, w))


@pytest.mark.parametrize("model_fn,message", [
    (_without_predictions, "model_fn returned no predictions to serve: pass Model(..., predictions="),
    (_tf_data_model_fn, "the predictions read tf.data input (IteratorGetNext); a served model takes its inputs "
                        "from placeholders"),
    (_wider, "holds w as [2, 1] but model_fn builds [3, 1]: give the model the sizes"),
    (_constant_predictions, "the predictions read no variable of the model"),
])
def test_a_model_that_cannot_be_served_says_why(tmp_path, model_fn, message):
    ckpt_dir, _, _ = _small_checkpoint(str(tmp_path))
    with pytest.raises(ModelError) as error:
        export.export_saved_model(model_fn, ckpt_dir, str(tmp_path / "served"))
    assert message in str(error.value)
    assert not os.path.exists(tmp_path / "served")


def test_where_to_read_and_write_is_checked_first(tmp_path):
    with pytest.raises(ConfigError, match="holds no checkpoint; give the directory a run wrote with --ckpt_dir"):
        export.export_saved_model(_wider, str(tmp_path), str(tmp_path / "served"))
    ckpt_dir, _, _ = _small_checkpoint(str(tmp_path))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "saved_model.pb").write_text("")
    with pytest.raises(ConfigError, match="export_dir .*taken exists and is not empty; give a new directory"):
        export.export_saved_model(_wider, ckpt_dir, str(tmp_path / "taken"))
    with pytest.raises(ModelError, match=r"Model\(predictions=...\) holds 'score': list"):
        export.export_saved_model(lambda: Model(loss=tf.constant(0.0), optimizer=tf.compat.v1.train.Optimizer(
            False, "o"), predictions={"score": [1.0]}), ckpt_dir, str(tmp_path / "served"))


def _linear(ctx):
    x = tf.compat.v1.placeholder(tf.float32, [None, 2], name="x")
    w = tf.compat.v1.get_variable("w", [2, 1])
    return Model(loss=tf.reduce_sum(w), optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.1),
                 predictions=tf.matmul(x, w))


@pytest.mark.parametrize("index", ["relative", "absolute"])
def test_a_moved_checkpoint_directory_is_exported_from_its_own_checkpoint(tmp_path, index):
    """`absolute`: an index naming its checkpoint by absolute path (the form earlier versions
    wrote), where the directory used to be; the directory's own step-7 is exported all the same."""
    ckpt_dir, _, w = _small_checkpoint(str(tmp_path))
    moved = str(tmp_path / "moved")
    os.rename(ckpt_dir, moved)
    if index == "absolute":
        old = os.path.join(ckpt_dir, "step-7", "model")
        with open(os.path.join(moved, "checkpoint"), "w") as f:
            f.write(f'model_checkpoint_path: "{old}"\nall_model_checkpoint_paths: "{old}"\n')
    export.export_saved_model(_linear, moved, str(tmp_path / "served"))
    x = np.array([[1.0, 2.0], [3.0, -1.0]], np.float32)
    served = tf.saved_model.load(str(tmp_path / "served")).signatures["serving_default"]
    np.testing.assert_allclose(served(x=tf.constant(x))["predictions"].numpy(), x @ w, atol=1e-6)


def _documented_export_commands():
    """Every `python -m parallax_tf export` command line README.md and docs/serving.md print."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = []
    for page in ("README.md", os.path.join("docs", "serving.md")):
        with open(os.path.join(root, page), encoding="utf-8") as f:
            found += [line.strip() for line in f if line.strip().startswith("python -m parallax_tf export ")]
    return found


def test_the_documented_export_commands_export_as_printed(tmp_path, monkeypatch, capsys):
    """Each command, word for word, in a directory whose `ckpt` holds a checkpoint of the model
    it names (its initial values, with the model's default flags)."""
    commands = _documented_export_commands()
    assert [re.search(r"--model (\S+)", c).group(1) for c in commands] == \
        ["models.criteo:from_flags", "models.recsys:from_flags"]
    for number, command in enumerate(commands):
        argv = shlex.split(command)
        assert argv[:4] == ["python", "-m", "parallax_tf", "export"]
        spec, ckpt_dir, export_dir = (argv[argv.index(f"--{name}") + 1] for name in ("model", "ckpt_dir", "export_dir"))
        (tmp_path / str(number)).mkdir()
        monkeypatch.chdir(tmp_path / str(number))
        model_fn = export.resolve_model_fn(spec)
        flags.FLAGS(["test"])
        graph = tf.Graph()
        with graph.as_default():
            model_fn(RunContext(serving=True))
            with tf.compat.v1.Session(graph=graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                os.makedirs(os.path.join(ckpt_dir, "step-1"))
                tf.compat.v1.train.Saver().save(sess, os.path.join(ckpt_dir, "step-1", "model"), write_state=False,
                                                write_meta_graph=False)
        monkeypatch.setattr(sys, "argv", ["parallax_tf", *argv[3:]])
        with pytest.raises(SystemExit) as ended:
            runpy.run_module("parallax_tf", run_name="__main__")
        assert ended.value.code == 0, capsys.readouterr().err
        assert capsys.readouterr().out.strip().splitlines()[-1] == f"exported {export_dir}"
        served = tf.saved_model.load(export_dir).signatures["serving_default"]
        assert list(served.structured_outputs) == ["probability"]


@pytest.mark.parametrize("form", ["space", "equals"])
def test_the_command_line_takes_each_flag_after_a_space_or_an_equals_sign(tmp_path, capsys, form):
    ckpt_dir, _, _ = _small_checkpoint(str(tmp_path))
    given = {"--model": "tests.test_export:_linear", "--ckpt_dir": ckpt_dir, "--export_dir": str(tmp_path / "out")}
    argv = [part for flag, value in given.items()
            for part in ([flag, value] if form == "space" else [f"{flag}={value}"])]
    assert export.main(argv) == 0, capsys.readouterr().err
    assert capsys.readouterr().out == f"exported {tmp_path / 'out'}\n"
    assert os.path.exists(tmp_path / "out" / "saved_model.pb")


def test_help_prints_the_usage_and_exits_0(capsys):
    """`python -m parallax_tf --help` (a process of its own), and `-h`, `help`, `export --help`."""
    proc = subprocess.run([sys.executable, "-m", "parallax_tf", "--help"], capture_output=True, text=True,
                          cwd=launch.ROOT, env=dict(os.environ, PYTHONPATH=launch.ROOT), timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", launch.tail(proc)
    both = ("usage: python -m parallax_tf check [--ops_dir=DIR] [--no_ranks]\n"
            "       python -m parallax_tf export --model module:name --ckpt_dir DIR --export_dir DIR [model flags]\n")
    assert proc.stdout.startswith(both)
    for argv, usage in ((["-h"], both), (["help"], both), (["export", "--help"], export.USAGE + "\n"),
                        (["export", "-h"], export.USAGE + "\n")):
        with pytest.MonkeyPatch.context() as patch, pytest.raises(SystemExit) as ended:
            patch.setattr(sys, "argv", ["parallax_tf", *argv])
            runpy.run_module("parallax_tf", run_name="__main__")
        printed = capsys.readouterr()
        assert ended.value.code == 0 and printed.out.startswith(usage) and printed.err == "", argv


@pytest.mark.parametrize("argv,message", [
    (["--ckpt_dir=d", "--export_dir=e"], "--model is missing; usage: python -m parallax_tf export"),
    (["--model", "--ckpt_dir=d", "--export_dir=e"], "--model is given without a value; usage: python -m parallax_tf"),
    (["--ckpt_dir=d", "--export_dir=e", "--model"], "--model is given without a value; usage: python -m parallax_tf"),
    (["--model=no_such_module:fn", "--ckpt_dir=d", "--export_dir=e"], "cannot import no_such_module"),
    (["--model=tests.jobs.recsys_job:nothing", "--ckpt_dir=d", "--export_dir=e"], "recsys_job has no function "
                                                                                   "nothing"),
    (["--model=tests.jobs.recsys_job:model_fn", "--ckpt_dir=d", "--export_dir=e", "--no_such_flag=1"],
     "Unknown command line flag 'no_such_flag'"),
])
def test_the_command_line_ends_with_one_line_and_status_2(capsys, argv, message):
    assert export.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("parallax_tf export: error: ") and message in err and len(err.strip().splitlines()) == 1


def test_a_fit_model_is_served_through_keras_own_save():
    """ptf.fit hands back the trained weights in the Keras model: Keras' own SavedModel of it
    (written on rank 0 of tests/test_fit's 2-rank job) serves what the model predicts there."""
    from tests.test_fit import _job
    saved = os.path.join(_job(2), "wide_deep.hybrid")
    served = dict(np.load(saved + ".served.npz"))
    want = served.pop("predictions")
    got = _serve(saved + ".saved", served)
    assert list(got["imported"]) == []
    for key in ("tf2:click", "v1:click"):
        np.testing.assert_allclose(got[key], want, rtol=0, atol=1e-6)
    assert want.std() > 1e-4


@pytest.mark.parametrize("front_end", ["tf_keras", "keras3"])
def test_a_fit_model_with_a_dynamic_table_is_served_through_keras_own_save(front_end):
    """A model whose ids go through ptf.<keras>.DynamicEmbedding, trained by ptf.fit on 2 ranks:
    Keras' own SavedModel of it (tf_keras' model.save, Keras 3's model.export, on rank 0 of
    tests/test_fit's and tests/test_tf2's jobs) reads the table's trained rows with standard ops
    and serves what the model predicted there."""
    if front_end == "tf_keras":
        from tests.test_fit import _job
        saved = os.path.join(_job(2), "dynamic_wide.hybrid")
        served = dict(np.load(saved + ".served.npz"))
        want, export_dir = served.pop("predictions").ravel(), saved + ".saved"
    else:
        from tests.test_tf2 import _job
        out = _job(2)
        served = dict(np.load(os.path.join(out, "dynamic_export.hybrid.npz")))
        want = json.loads(str(np.load(os.path.join(out, "keras3_fit_dynamic.hybrid.rank0.npz"))["extra"]))["predict"]
        export_dir = os.path.join(out, "dynamic_export.hybrid")
    got = _serve(export_dir, served)
    assert list(got["imported"]) == [] and served["ids"].min() > 10 ** 12
    outputs = sorted(k for k in got if k.startswith(("tf2:", "v1:")))
    assert len(outputs) == 2, outputs
    for key in outputs:
        np.testing.assert_allclose(np.ravel(got[key]), want, rtol=0, atol=1e-6)

