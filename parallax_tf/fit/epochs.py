"""Epoch ends under ptf.fit: the epoch's logs over the whole global batch, validation, the
user's callbacks on rank 0, and one decision every rank follows.

Every rank runs the EpochEnds hook. At an epoch's last step the training logs come from the
step reports (the same on every rank); rank 0 alone puts the trained weights into the eager
model, validates as model.evaluate does and calls the callbacks; its logs and whether a
callback stopped training reach every rank in one Horovod broadcast, so all ranks stop after
the same step, before the next one starts."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import numpy as np

from parallax_tf.errors import ConfigError
from parallax_tf.fit.graph import metric_result
from parallax_tf.fit.spec import eagerly
from parallax_tf.runtime import rank_objects
from parallax_tf.runtime.hooks import Hook, LiveRun

BATCH_METHODS = ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end")


def check_callbacks(callbacks: List[object]) -> None:
    """One error naming the first callback fit cannot serve, and why."""
    import tf_keras
    cb = tf_keras.callbacks
    refused = {cb.ReduceLROnPlateau: "it changes the eager model's optimizer, which trains nothing under ptf.fit; "
                                     "give compile's optimizer a learning-rate schedule instead",
               cb.LearningRateScheduler: "it changes the eager model's optimizer, which trains nothing under "
                                         "ptf.fit; give compile's optimizer a learning-rate schedule instead",
               cb.BackupAndRestore: "ptf.fit resumes from --ckpt_dir at the step it stopped (and --max_restarts "
                                    "restarts a lost rank)",
               cb.ProgbarLogger: "ptf.fit prints its own progress: verbose=1 a line every --log_every steps and "
                                 "one per epoch, verbose=2 one per epoch"}
    for callback in callbacks:
        why = next((text for kind, text in refused.items() if isinstance(callback, kind)), None)
        if why is None and isinstance(callback, cb.ModelCheckpoint) and callback.save_freq != "epoch":
            why = "it saves every few batches, and the trained weights reach rank 0's model at epoch ends: " \
                  "give save_freq='epoch'"
        elif why is None and isinstance(callback, cb.TensorBoard) and callback.update_freq != "epoch":
            why = "its update_freq is per batch; give update_freq='epoch' (--logdir writes per-step scalars)"
        elif why is None and not isinstance(callback, (cb.ModelCheckpoint, cb.TensorBoard, cb.TerminateOnNaN)) \
                and _batch_methods(callback):
            why = f"it acts on every training batch ({', '.join(_batch_methods(callback))}), and ptf.fit's " \
                  "callbacks see the model at epoch ends; move that work to on_epoch_end"
        if why:
            raise ConfigError(f"ptf.fit cannot take the callback {type(callback).__name__}: {why}")


def _batch_methods(callback) -> List[str]:
    import tf_keras
    base = tf_keras.callbacks.Callback
    return [name for name in BATCH_METHODS
            if name in vars(callback) or getattr(type(callback), name) is not getattr(base, name)]


class EpochEnds(Hook):
    """The hook behind fit's epochs (see the module's docstring)."""

    def __init__(self, spec, per_epoch: int, initial_epoch: int, epochs: int, rows_of: Callable[[int], int],
                 built_metrics, callbacks: list, history, validate: Optional[Callable[[], dict]],
                 verbose: int):
        self.spec, self.per_epoch, self.initial_epoch, self.epochs = spec, per_epoch, initial_epoch, epochs
        self.rows_of, self.built_metrics, self.callbacks = rows_of, built_metrics, callbacks
        self.history, self.validate, self.verbose = history, validate, verbose
        self.reads_weights = bool(callbacks) or validate is not None     # the same on every rank
        self.live: Optional[LiveRun] = None
        self.start = 0
        self.logs: Dict[str, float] = {}

    def attach(self, live):
        import tf_keras
        if not live.stops_together:
            raise ConfigError("ptf.fit needs a strategy whose ranks step together (hybrid, ps, allreduce, auto, "
                              "stanza, slim_dp): an epoch's end and a callback's stop must fall on the same step on "
                              "every rank")
        self.live = live
        # rank 0's alone: a callback may open its files as soon as it meets the model
        self.callbacks = tf_keras.callbacks.CallbackList(self.callbacks, model=self.spec.model, epochs=self.epochs,
                                                         steps=self.per_epoch, verbose=0) \
            if self.chief and self.callbacks else None

    @property
    def chief(self) -> bool:
        return self.live.rank == 0

    def begin(self, step):
        self.start = step
        if self.chief and self.callbacks is not None:
            with eagerly():
                self.callbacks.on_train_begin()
                self.callbacks.on_epoch_begin(self.initial_epoch + step // self.per_epoch)

    def after_step(self, step, loss, stats):
        if step % self.per_epoch:
            return
        epoch = self.initial_epoch + step // self.per_epoch - 1
        logs = self._train_logs(step, stats)
        values = self.live.read_state() if self.reads_weights and (self.chief or self.live.reads_together) else None
        stop = False
        with eagerly():
            if self.chief:
                self.spec.eager_classes()
                if values is not None:
                    self.spec.set_weights(values)
                if self.validate is not None:
                    logs.update(self.validate())
                if self.callbacks is not None:
                    self.callbacks.on_epoch_end(epoch, logs)
                stop = bool(self.spec.model.stop_training)
            if self.live.size > 1:
                logs, stop = rank_objects.broadcast((logs, stop), name="parallax_fit_epoch_end")
        self.history.on_epoch_end(epoch, logs)
        self.logs = logs
        if self.chief and self.verbose:
            print(f"epoch {epoch + 1}/{self.epochs} " + " ".join(f"{k} {v:.4f}" for k, v in logs.items()), flush=True)
        if stop:
            stats.stop_requested = True
        elif self.chief and self.callbacks is not None and epoch + 1 < self.epochs:
            with eagerly():
                self.callbacks.on_epoch_begin(epoch + 1)

    def end(self, step):
        if self.chief and self.callbacks is not None:
            with eagerly():
                self.callbacks.on_train_end(self.logs)

    def _train_logs(self, step: int, stats) -> Dict[str, float]:
        """The epoch ending at `step`, over the steps this run trained (a resumed run may begin
        mid-epoch): the loss is the mean of the batches' losses weighted by their rows; a
        metric's value comes from its state summed over those steps and every rank."""
        steps = [s for s in range(step - self.per_epoch, step) if s >= self.start]
        at = [s - self.start for s in steps]
        logs = {"loss": float(np.average([stats.losses[i] for i in at], weights=[self.rows_of(s) for s in steps]))}
        # each step's report: the mean over ranks of their states, or the state per row of its batch
        scale = [self.rows_of(s) if self.built_metrics.per_row else self.live.size for s in steps]
        for key, remake in self.built_metrics.remakes.items():
            state = np.sum([k * np.asarray(stats.metrics[key][i]) for k, i in zip(scale, at)], 0)
            logs[key] = metric_result(remake, state)
        return logs
