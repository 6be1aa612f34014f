"""A SavedModel to serve, from a checkpoint and the model's own forward graph.

    ptf.export_saved_model(model_fn, ckpt_dir, export_dir)
    python -m parallax_tf export --model module:name --ckpt_dir D --export_dir E [the model's flags]

model_fn is called once more, with ctx.serving true, in a graph of its own; the variables
`Model.predictions` reads are restored from the checkpoint (which holds single-device names,
whatever strategy wrote it). The SavedModel's `serving_default` signature takes the
placeholders the predictions depend on, keyed by their names, and returns the predictions
(`predictions`, or the dict's keys). Its graph is the model_fn's own: standard TensorFlow ops,
loadable by `tf.saved_model.load` and by TF Serving without parallax_tf. Lookup tables are
initialised by the SavedModel's init op, vocabulary files travel as its assets."""
from __future__ import annotations

import importlib
import inspect
import os
import shutil
import sys
from typing import Callable, Dict, List, Tuple

import tensorflow as tf

from parallax_tf import dynamic, graph_walk
from parallax_tf.checkpoint import CheckpointStore
from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.errors import ConfigError, ModelError, UserError
from parallax_tf.inspect_graph import logical_name
from parallax_tf.model import Model, RunContext
from parallax_tf.runtime import quiet
from parallax_tf.training_graph import call_model_fn

USAGE = ("usage: python -m parallax_tf export --model module:name --ckpt_dir DIR --export_dir DIR "
         "[the model module's flags]")
HELP = f"""{USAGE}

Writes a SavedModel of the model's predictions with the latest checkpoint of --ckpt_dir
(docs/serving.md). Each of the three takes its value after a space or after '='.
  --model module:name  a model_fn, or a function of no arguments that returns one (or a
                       (model_fn, input_fn) pair, as the reference models' from_flags)
  --ckpt_dir DIR       the directory a run wrote with --ckpt_dir, or one checkpoint's path
                       (DIR/step-N/model)
  --export_dir DIR     where the SavedModel goes: a new or empty directory (TF Serving reads
                       base/1, base/2, ...)
Every other argument is the model module's own flag (its sizes), as it was trained with."""
_OWN_FLAGS = ("model", "ckpt_dir", "export_dir")


def export_saved_model(model_fn: Callable, ckpt_dir: str, export_dir: str) -> str:
    """Writes the SavedModel of model_fn's predictions with the latest checkpoint of ckpt_dir
    (or the checkpoint ckpt_dir names) into export_dir, which must not exist or be empty;
    returns export_dir. TF Serving reads a base directory's numbered versions: export to
    base/1, base/2, ..."""
    quiet.apply(verbose=False)
    checkpoint = _checkpoint_path(ckpt_dir)
    target = os.path.abspath(export_dir)
    if os.path.exists(target) and (not os.path.isdir(target) or os.listdir(target)):
        raise ConfigError(f"export_dir {export_dir} exists and is not empty; give a new directory")
    graph = tf.Graph()
    with graph.as_default():
        with dynamic.serving():          # dynamic tables read the checkpoint's live rows
            model = call_model_fn(model_fn, RunContext(serving=True))
        outputs = _outputs(model)
        needed = set().union(*(graph_walk.ancestors(t) for t in outputs.values()))
        inputs = _inputs(outputs, needed)
        restored = _variables_read(graph, needed)
        _check_checkpoint(checkpoint, restored)
        saver = tf.compat.v1.train.Saver(var_list=restored, sharded=True)
        init = tf.group(tf.compat.v1.tables_initializer(), tf.compat.v1.local_variables_initializer(),
                        name="serving_init")
        staging = f"{target}.staging-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            with tf.compat.v1.Session(graph=graph) as sess:
                saver.restore(sess, checkpoint)
                builder = tf.compat.v1.saved_model.Builder(staging)
                signature = tf.compat.v1.saved_model.predict_signature_def(inputs, outputs)
                builder.add_meta_graph_and_variables(
                    sess, [tf.saved_model.SERVING], strip_default_attrs=True, saver=saver, main_op=init,
                    signature_def_map={tf.saved_model.DEFAULT_SERVING_SIGNATURE_DEF_KEY: signature},
                    assets_collection=graph.get_collection(tf.compat.v1.GraphKeys.ASSET_FILEPATHS))
                builder.save()
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    if os.path.isdir(target):
        os.rmdir(target)                 # empty (checked above)
    os.rename(staging, target)
    return export_dir


def _checkpoint_path(ckpt_dir: str) -> str:
    """The latest checkpoint in ckpt_dir, or ckpt_dir itself when it names one."""
    latest = CheckpointStore(ckpt_dir).latest() if os.path.isdir(ckpt_dir) else None
    if latest:
        return latest
    if tf.io.gfile.exists(ckpt_dir + ".index"):
        return ckpt_dir
    raise ConfigError(f"ckpt_dir {ckpt_dir} holds no checkpoint; give the directory a run wrote with --ckpt_dir "
                      "(or one checkpoint's path, e.g. D/step-100/model)")


def _outputs(model: Model) -> Dict[str, tf.Tensor]:
    if model.predictions is None:
        raise ModelError("model_fn returned no predictions to serve: pass Model(..., predictions=<tensor or "
                         "{name: tensor}>), e.g. tf.sigmoid(logits)")
    if isinstance(model.predictions, dict):
        return dict(model.predictions)
    return {"predictions": model.predictions}


def _inputs(outputs: Dict[str, tf.Tensor], needed: set) -> Dict[str, tf.Tensor]:
    """The placeholders the predictions (whose ancestors are `needed`) need, by name; tf.data
    input cannot be served."""
    graph = next(iter(outputs.values())).graph
    iterators = sorted(op.name for op in needed if op.type in graph_walk.ITERATOR_READ_OPS)
    if iterators:
        raise ModelError(f"the predictions read tf.data input ({iterators[0]}); a served model takes its inputs "
                         "from placeholders: when ctx.serving is true, build them with tf.compat.v1.placeholder")
    return {name: graph.get_tensor_by_name(name + ":0") for name in graph_walk.needed_placeholders(*outputs.values())}


def _variables_read(graph: tf.Graph, needed: set) -> List:
    """The model's global variables among the predictions' ancestors `needed` (local ones start
    from the init op)."""
    read = [v for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES) if v.op in needed]
    if not read:
        raise ModelError("the predictions read no variable of the model, so the checkpoint has nothing to give "
                         "them: pass the tensor the trained model computes (e.g. tf.sigmoid(logits))")
    return read


def _saved_shape(variable) -> List[int]:
    info = tf_shim.save_slice_info(variable)
    return list(info.full_shape) if info is not None else variable.shape.as_list()


def _check_checkpoint(checkpoint: str, variables) -> None:
    """Every variable the predictions read is in the checkpoint, in its shape."""
    held = tf.train.load_checkpoint(checkpoint).get_variable_to_shape_map()
    missing = sorted({logical_name(v) for v in variables} - set(held))
    if missing:
        raise ModelError(f"checkpoint {checkpoint} lacks {missing[:5]}, which the predictions read: it was written "
                         "by another model_fn (or with other flags)")
    for variable in variables:
        name, shape = logical_name(variable), _saved_shape(variable)
        if not tf.TensorShape(shape).is_compatible_with(held[name]):     # a dynamic table's rows: any count
            raise ModelError(f"checkpoint {checkpoint} holds {name} as {list(held[name])} but model_fn builds "
                             f"{shape}: give the model the sizes (flags) it was trained with")


def resolve_model_fn(spec: str) -> Callable:
    """`module:name` to a model_fn: name is one, or a function of no arguments that returns one
    (or a (model_fn, input_fn) pair, as the reference models' from_flags)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--model={spec}: give module:name, e.g. models.recsys:from_flags")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"--model={spec}: cannot import {module_name} ({error}); run from the directory that "
                          "holds it or put it on PYTHONPATH") from None
    if not callable(getattr(module, attr, None)):
        raise ConfigError(f"--model={spec}: {module_name} has no function {attr}")
    named = getattr(module, attr)

    def model_fn(ctx):
        if _takes_argument(named):
            return call_model_fn(named, ctx)
        made = named()               # a model_fn() without ctx builds its Model here
        made = made[0] if isinstance(made, tuple) and made else made
        if isinstance(made, Model):
            return call_model_fn(lambda: made, ctx)
        if not callable(made):
            raise ConfigError(f"--model={spec} returned {type(made).__name__}, neither a ptf.Model nor a model_fn")
        return call_model_fn(made, ctx)
    return model_fn


def _takes_argument(function: Callable) -> bool:
    try:
        return len(inspect.signature(function).parameters) >= 1
    except (TypeError, ValueError):
        return False


def _own_and_model_flags(argv: List[str]) -> Tuple[Dict[str, str], List[str]]:
    """Export's own flags (`--name value` or `--name=value`) by name, and the rest: the model
    module's flags."""
    given, rest = {}, []
    arguments = iter(argv)
    for arg in arguments:
        key, equals, value = arg.partition("=")
        name = key[2:] if key.startswith("--") else None
        if name not in _OWN_FLAGS:
            rest.append(arg)
            continue
        if not equals:
            value = next(arguments, "")
        if not value or (not equals and value.startswith("-")):
            raise ConfigError(f"--{name} is given without a value; {USAGE}")
        given[name] = value
    return given, rest


def main(argv: List[str]) -> int:
    """`python -m parallax_tf export ...`: 0, or 2 with one line naming the mistake."""
    from absl import flags
    if any(arg in ("--help", "-h") for arg in argv):
        print(HELP)
        return 0
    try:
        given, rest = _own_and_model_flags(argv)
        rest = ["parallax_tf export"] + rest
        absent = [k for k in _OWN_FLAGS if k not in given]
        if absent:
            raise ConfigError(f"--{absent[0]} is missing; {USAGE}")
        model_fn = resolve_model_fn(given["model"])
        try:
            flags.FLAGS(rest)                # the model module's flags (its sizes)
        except flags.Error as error:
            raise ConfigError(f"{error}; {USAGE}") from None
        written = export_saved_model(model_fn, given["ckpt_dir"], given["export_dir"])
    except UserError as error:
        print(f"parallax_tf export: error: {error}", file=sys.stderr)
        return 2
    print(f"exported {written}")
    return 0
