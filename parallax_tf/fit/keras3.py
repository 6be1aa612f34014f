"""ptf.fit for a compiled Keras 3 model, through the TF2 front end (parallax_tf.tf2).

Each epoch is one ptf.run of the model's own `train_step` (Keras 3's TensorFlowTrainer: the
compiled loss under a GradientTape, the optimizer's apply, the loss tracker and compiled metrics
updated) over that epoch's global batches, split over the ranks. The run writes the trained
state back into the model on every rank: weights, the optimizer's variables and the metrics'
state (summed over ranks, as their result needs). The epoch's logs are then the model's own
metric results, validation is the model's own evaluate (on every rank, which holds the same
weights), and the callbacks run on rank 0, whose decision to stop every rank follows."""
from __future__ import annotations

import math
from typing import Dict

import numpy as np
import tensorflow as tf

from parallax_tf.errors import ConfigError

REFUSED = {"validation_freq": "ptf.fit validates after every epoch",
           "max_queue_size": "ptf.fit reads x in the rank's own process",
           "workers": "ptf.fit reads x in the rank's own process",
           "use_multiprocessing": "ptf.fit reads x in the rank's own process"}


def is_keras3_model(model) -> bool:
    module = type(model).__module__
    return module == "keras" or module.startswith("keras.")


def fit(model, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None, validation_split=0.0,
        validation_data=None, shuffle=True, class_weight=None, sample_weight=None, initial_epoch=0,
        steps_per_epoch=None, validation_steps=None, validation_batch_size=None, seed: int = 0, **options):
    """ptf.fit for a compiled Keras 3 model (or a function building one): arguments as
    keras.Model.fit's, `batch_size` the global batch; returns a keras History."""
    import keras
    from parallax_tf import rank_run
    from parallax_tf.api import run
    refused = sorted(k for k in options if k in REFUSED)
    if refused:
        raise ConfigError(f"ptf.fit does not take {refused[0]}: {REFUSED[refused[0]]}")
    if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", False):
        raise ConfigError("ptf.fit needs a compiled model: call model.compile(optimizer=..., loss=...) first")
    if epochs <= initial_epoch:
        raise ConfigError(f"fit's epochs={epochs} trains nothing after initial_epoch={initial_epoch}")
    epochs_data, held_out = _epochs(x, y, sample_weight, class_weight, batch_size, shuffle, seed, validation_split,
                                    steps_per_epoch)
    validation = held_out if held_out is not None else validation_data
    verbose = 1 if verbose == "auto" else int(verbose)
    if verbose in (0, 2):
        options.setdefault("log_every", 0)
    history = keras.callbacks.History()
    history.set_model(model)
    history.on_train_begin()
    # the script's callbacks run on rank 0 only (files, logs); every rank keeps its History
    callback_list = keras.callbacks.CallbackList(list(callbacks or []) if rank_run.rank() == 0 else [], model=model)
    model.stop_training = False
    callback_list.on_train_begin()

    def train_step(*element):
        return model.train_step(element)

    result = None
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        callback_list.on_epoch_begin(epoch)
        result = run(train_step, epochs_data(epoch), steps=steps_per_epoch, **options)
        if result.plan_only:
            break
        logs = {name: float(value) for name, value in model.get_metrics_result().items()}
        logs.update(_validated(model, validation, validation_batch_size or batch_size, validation_steps))
        history.on_epoch_end(epoch, logs)
        callback_list.on_epoch_end(epoch, logs)
        stop = bool(model.stop_training) if rank_run.rank() == 0 else False
        if verbose and rank_run.rank() == 0:
            print(f"epoch {epoch + 1}/{epochs} " + " ".join(f"{k} {v:.4f}" for k, v in logs.items()), flush=True)
        if rank_run.size() > 1:
            from parallax_tf.runtime import rank_objects
            stop = rank_objects.broadcast(stop, name="parallax_fit_epoch_end")
        if stop:
            break
    callback_list.on_train_end()
    history.plan = result.plan if result is not None else None
    history.rank, history.size = rank_run.rank(), rank_run.size()
    model.history = history
    return history


def _validated(model, validation, batch_size, steps) -> Dict[str, float]:
    if validation is None:
        return {}
    if isinstance(validation, tf.data.Dataset):
        found = model.evaluate(validation, steps=steps, verbose=0, return_dict=True)
    else:
        parts = tuple(validation)
        if len(parts) not in (2, 3):
            raise ConfigError("fit's validation_data is (x, y) or (x, y, sample_weight), or a dataset")
        found = model.evaluate(parts[0], parts[1], sample_weight=parts[2] if len(parts) == 3 else None,
                               batch_size=batch_size or 32, steps=steps, verbose=0, return_dict=True)
    return {f"val_{k}": float(v) for k, v in found.items()}


def _epochs(x, y, sample_weight, class_weight, batch_size, shuffle, seed, validation_split, steps_per_epoch):
    """(epoch -> that epoch's dataset of global batches, validation_split's held-out (x, y, weight))."""
    if isinstance(x, tf.data.Dataset):
        if y is not None or sample_weight is not None or batch_size is not None:
            raise ConfigError("fit's x is a dataset of (x, y[, sample_weight]) batches: give no y, sample_weight "
                              "or batch_size besides it")
        if validation_split:
            raise ConfigError("fit's validation_split needs array input; with a dataset give validation_data")
        if class_weight:
            raise ConfigError("fit's class_weight needs array input; with a dataset give sample weights in it")
        return (lambda epoch: x), None
    if x is None or y is None:
        raise ConfigError("ptf.fit needs x and y: arrays (or dicts or lists of them), or a dataset of (x, y) batches")
    if steps_per_epoch is not None:
        raise ConfigError("fit's steps_per_epoch is for a dataset input; with arrays an epoch is every batch")
    arrays = (x, y, sample_weight)
    rows = len(tf.nest.flatten(y)[0])
    held = None
    if validation_split:
        at = int(math.floor(rows * (1.0 - validation_split)))
        if not 0 < validation_split < 1 or at in (0, rows):
            raise ConfigError(f"fit's validation_split={validation_split} leaves no rows to train or to validate "
                              f"({rows} rows); give a fraction between 0 and 1")
        held = _rows(arrays, np.arange(at, rows))
        arrays, rows = _rows(arrays, np.arange(at)), at
    if class_weight:
        weights = _class_weights(arrays[1], class_weight)
        arrays = (arrays[0], arrays[1], weights if arrays[2] is None else np.asarray(arrays[2]) * weights)
    batch = batch_size or 32

    def epoch_data(epoch: int):
        order = np.random.RandomState(seed + epoch).permutation(rows) if shuffle else np.arange(rows)
        taken = _rows(arrays, order)
        element = taken if taken[2] is not None else taken[:2]
        return tf.data.Dataset.from_tensor_slices(element).batch(batch)
    return epoch_data, held


def _rows(arrays, at: np.ndarray):
    return tuple(None if a is None else tf.nest.map_structure(lambda v: np.asarray(v)[at], a) for a in arrays)


def _class_weights(y, class_weight: dict) -> np.ndarray:
    """Keras' class_weight as per-row weights (class from the label, or the argmax of a one-hot one)."""
    if len(tf.nest.flatten(y)) > 1:
        raise ConfigError("fit's class_weight is only for a model with a single output, as in Keras")
    labels = np.asarray(tf.nest.flatten(y)[0])
    if labels.ndim > 1:
        labels = np.argmax(labels, -1) if labels.shape[-1] != 1 else np.squeeze(labels, -1)
    return np.array([class_weight.get(int(c), 1.0) for c in np.round(labels).astype(np.int32)], np.float32)
