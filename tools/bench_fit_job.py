"""One rank of tools.bench_fit: trains models.keras_recsys in one --form and rank 0 prints
`epoch_s <epoch> <seconds>` per epoch (no validation, so an epoch is training alone).

fit:       ptf.fit on the compiled model (parallax_tf's flags: --strategy, ...)
model_fn:  the same layers written as a model_fn (placeholders, legacy Adagrad, the mean
           binary cross-entropy), the same global batches split over the ranks, ptf.run
horovod:   horovod.tensorflow.keras: DistributedOptimizer + BroadcastGlobalVariablesCallback,
           each rank fitting its slice of the rows (batch_size / ranks); run under horovodrun"""
import os
import sys
import time

import numpy as np
from absl import app, flags

flags.DEFINE_enum("form", "fit", ["fit", "model_fn", "horovod"], "How the model is trained.")
flags.DEFINE_integer("bench_rows", 20000, "Training rows.")
flags.DEFINE_integer("bench_batch", 256, "Global batch.")
flags.DEFINE_integer("bench_epochs", 3, "Epochs (the first includes start-up).")
FLAGS = flags.FLAGS
USERS, ITEMS, LEARNING_RATE = 50000, 5000, 0.05


def rank() -> int:
    return int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))


def epoch_timer():
    import tf_keras

    class Timer(tf_keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.began = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            if rank() == 0:
                print(f"epoch_s {epoch} {time.perf_counter() - self.began:.4f}", flush=True)
    return Timer()


def train_fit(x, y):
    import parallax_tf as ptf
    from models import keras_recsys
    ptf.fit(keras_recsys.build_model(USERS, ITEMS), x, y, batch_size=FLAGS.bench_batch, epochs=FLAGS.bench_epochs,
            shuffle=False, callbacks=[epoch_timer()], verbose=0)


def train_model_fn(x, y):
    import parallax_tf as ptf
    import tensorflow as tf
    import tf_keras
    from models import keras_recsys
    from parallax_tf.runtime.hooks import Hook
    per_epoch = -(-len(y) // FLAGS.bench_batch)

    def model_fn():
        net = keras_recsys.build_model(USERS, ITEMS)
        label = tf.compat.v1.placeholder(tf.float32, [None, 1], name="label")
        loss = tf.reduce_mean(tf_keras.losses.binary_crossentropy(label, net.output))
        return ptf.Model(loss=loss, optimizer=tf.compat.v1.train.AdagradOptimizer(LEARNING_RATE))

    def input_fn(ctx):
        epoch_rows = np.arange(len(y))[(ctx.step % per_epoch) * FLAGS.bench_batch:][:FLAGS.bench_batch]
        mine = np.array_split(epoch_rows, ctx.size)[ctx.rank]
        return {**{name: v[mine] for name, v in x.items()}, "label": y[mine]}

    class Timer(Hook):
        def begin(self, step):
            self.began = time.perf_counter()

        def after_step(self, step, loss, stats):
            if step % per_epoch == 0 and rank() == 0:
                print(f"epoch_s {step // per_epoch - 1} {time.perf_counter() - self.began:.4f}", flush=True)
                self.began = time.perf_counter()
    ptf.run(model_fn, input_fn, steps=FLAGS.bench_epochs * per_epoch, hooks=[Timer()], log_every=0)


def train_horovod(x, y):
    import horovod.tensorflow.keras as hvd
    import tf_keras
    from models import keras_recsys
    hvd.init()
    model = keras_recsys.build_model(USERS, ITEMS)
    model.compile(optimizer=hvd.DistributedOptimizer(tf_keras.optimizers.legacy.Adagrad(LEARNING_RATE)),
                  loss="binary_crossentropy", metrics=[tf_keras.metrics.AUC(name="auc")])
    mine = np.array_split(np.arange(len(y)), hvd.size())[hvd.rank()]
    model.fit({k: v[mine] for k, v in x.items()}, y[mine], batch_size=FLAGS.bench_batch // hvd.size(),
              epochs=FLAGS.bench_epochs, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), epoch_timer()])


def main(argv):
    from models import keras_recsys
    x, y = keras_recsys.make_data(FLAGS.bench_rows, USERS, ITEMS)
    {"fit": train_fit, "model_fn": train_model_fn, "horovod": train_horovod}[FLAGS.form](x, y)


if __name__ == "__main__":
    if "--form=horovod" not in sys.argv:
        import parallax_tf  # noqa: F401  (before TensorFlow; registers its flags)
    else:
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    app.run(main)
