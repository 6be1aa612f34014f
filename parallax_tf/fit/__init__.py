"""ptf.fit: a Keras compile/fit script on many ranks. A Keras 3 model trains through the TF2
front end (keras3.py); a tf_keras one as follows.

The compiled model is rebuilt inside the toolkit's model_fn from its config, every variable
starting from the eager model's own value (spec); compile's optimizer becomes the legacy one
with the same hyperparameters (the new Keras optimizers update nothing in a v1 graph) and its
loss is computed over the global batch (graph). Each global batch of `batch_size` rows is split
over the ranks that read data, in order (np.array_split); epochs end in one decision every rank
follows (epochs)."""
from __future__ import annotations

import numpy as np

from parallax_tf.compat import tf_keras as keras_shim
from parallax_tf.errors import ConfigError
from parallax_tf.fit import keras3
from parallax_tf.fit.data import (ArrayBatches, DatasetBatches, as_batch, keras_arguments, split_off_validation,
                                  with_class_weights)
from parallax_tf.fit.epochs import EpochEnds, check_callbacks
from parallax_tf.fit.graph import GLOBAL_ROWS, BuiltMetrics, fit_model_fn
from parallax_tf.fit.spec import KerasSpec

# tf_keras.Model.fit's arguments ptf.fit refuses, each with why
REFUSED = {"validation_freq": "ptf.fit validates after every epoch",
           "max_queue_size": "ptf.fit reads x in the rank's own process",
           "workers": "ptf.fit reads x in the rank's own process",
           "use_multiprocessing": "ptf.fit reads x in the rank's own process"}


def fit(model, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None, validation_split=0.0,
        validation_data=None, shuffle=True, class_weight=None, sample_weight=None, initial_epoch=0,
        steps_per_epoch=None, validation_steps=None, validation_batch_size=None, seed: int = 0, **options):
    """Trains a compiled Keras 3 or tf_keras model (or a function returning one) as `model.fit`
    would on one device, on every rank of the job, and returns a tf_keras History whose `model` holds
    the trained weights on every rank, whose `plan` is the run's plan and whose `rank` and `size`
    say which rank of how many this process is. Arguments mean what
    they mean to tf_keras.Model.fit; `batch_size` is the global batch; with shuffle, epoch e's
    order is a permutation seeded by seed + e, the same on every rank. Other keywords are
    parallax_tf.run's options (strategy, ckpt_dir, ...)."""
    import tf_keras
    from parallax_tf.api import run
    arguments = dict(x=x, y=y, batch_size=batch_size, epochs=epochs, verbose=verbose, callbacks=callbacks,
                     validation_split=validation_split, validation_data=validation_data, shuffle=shuffle,
                     class_weight=class_weight, sample_weight=sample_weight, initial_epoch=initial_epoch,
                     steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
                     validation_batch_size=validation_batch_size, seed=seed, **options)
    built, counters = None, None
    if not keras3.is_keras3_model(model) and not isinstance(model, tf_keras.Model) and callable(model):
        counters = keras_shim.layer_name_counters()
        built = model()
    if keras3.is_keras3_model(built if built is not None else model):
        return keras3.fit(built if built is not None else model, **arguments)
    refused = sorted(k for k in options if k in REFUSED)
    if refused:
        raise ConfigError(f"ptf.fit does not take {refused[0]}: {REFUSED[refused[0]]}")
    spec = KerasSpec(model, built, counters)
    spec.adopt(_first_inputs(x))
    data, held_out = _training_data(spec, x, y, batch_size, shuffle, class_weight, sample_weight, steps_per_epoch,
                                    seed + initial_epoch, validation_split)
    validate = _validation(spec, held_out if held_out is not None else validation_data,
                           validation_batch_size or batch_size, validation_steps)
    callbacks = list(callbacks or [])
    check_callbacks(callbacks)
    if epochs <= initial_epoch:
        raise ConfigError(f"fit's epochs={epochs} trains nothing after initial_epoch={initial_epoch}")
    verbose = 1 if verbose == "auto" else int(verbose)
    history = tf_keras.callbacks.History()
    history.set_model(spec.model)
    history.on_train_begin()
    built_metrics = BuiltMetrics()
    epoch_ends = EpochEnds(spec, data.per_epoch, initial_epoch, epochs, data.rows_of, built_metrics, callbacks,
                           history, validate, verbose)
    if verbose in (0, 2):
        options.setdefault("log_every", 0)
    spec.model.stop_training = False
    result = run(fit_model_fn(spec, data.first(), lambda ctx: ctx.size, built_metrics), _rank_shares(data),
                 steps=(epochs - initial_epoch) * data.per_epoch, hooks=[epoch_ends], **options)
    history.plan = result.plan
    history.rank, history.size = result.rank, result.size
    if not result.plan_only:
        spec.set_weights(result.variables)
    spec.model.history = history
    return history


def _rank_shares(data):
    """input_fn of the run: this rank's rows of step's global batch (np.array_split over the
    ranks) and the global batch's row count."""
    def input_fn(ctx):
        batch = data.batch(ctx.step)
        rows = len(next(iter(batch.values())))
        mine = np.array_split(np.arange(rows), ctx.size)[ctx.rank]
        return {**{name: array[mine] for name, array in batch.items()}, GLOBAL_ROWS: np.float32(rows)}
    return input_fn


def _first_inputs(x):
    """The inputs of x's first row (or batch, for a dataset), as given."""
    import tensorflow as tf
    if isinstance(x, tf.data.Dataset):
        element = next(iter(x))
        x = element[0] if isinstance(element, (tuple, list)) else element
        return tf.nest.map_structure(np.asarray, x)
    if x is None:
        raise ConfigError("ptf.fit needs x: arrays, a dict of arrays by input name, or a dataset")
    if isinstance(x, dict):
        return {k: np.asarray(v)[:1] for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [np.asarray(v)[:1] for v in x]
    return np.asarray(x)[:1]


def _training_data(spec, x, y, batch_size, shuffle, class_weight, sample_weight, steps_per_epoch, seed,
                   validation_split):
    """(the global batches, validation_split's held-out rows as (x, y, sample_weight) or None)."""
    import tensorflow as tf
    if isinstance(x, tf.data.Dataset):
        if y is not None or sample_weight is not None or batch_size is not None:
            raise ConfigError("fit's x is a dataset of (x, y[, sample_weight]) batches: give no y, sample_weight "
                              "or batch_size besides it")
        if validation_split:
            raise ConfigError("fit's validation_split needs array input; with a dataset give validation_data")
        return DatasetBatches(spec, x, steps_per_epoch, class_weight), None
    if steps_per_epoch is not None:
        raise ConfigError("fit's steps_per_epoch is for a dataset input; with arrays an epoch is every batch")
    batch, held_out = as_batch(spec, x, y, sample_weight), None
    if validation_split:      # split before class weights, which weigh training only (as in Keras)
        batch, held = split_off_validation(batch, validation_split)
        held_out = tuple(keras_arguments(spec, held).values())
    if class_weight:
        batch = with_class_weights(spec, batch, class_weight)
    return ArrayBatches(batch, batch_size or 32, shuffle, seed), held_out


def _validation(spec, validation_data, batch_size, steps):
    """() -> {"val_<name>": value} as single-device fit's validation computes it, or None."""
    import tensorflow as tf
    if validation_data is None:
        return None
    if isinstance(validation_data, tf.data.Dataset):
        arguments = {"x": validation_data, "steps": steps}
    else:
        parts = tuple(validation_data)
        if len(parts) not in (2, 3):
            raise ConfigError("fit's validation_data is (x, y) or (x, y, sample_weight), or a dataset")
        arguments = {"x": parts[0], "y": parts[1], "sample_weight": parts[2] if len(parts) == 3 else None,
                     "batch_size": batch_size or 32, "steps": steps}

    def validate() -> dict:
        found = spec.model.evaluate(**arguments, verbose=0, return_dict=True)
        return {f"val_{k}": float(v) for k, v in found.items()}
    return validate
