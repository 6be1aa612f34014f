"""ptf.fit for argv[1] epochs (the toolkit's flags after it, e.g. --ckpt_dir); rank 0 prints the
History and the trained weights. With PARALLAX_TEST_DIE_AT_EPOCH=E and a stamp path in
PARALLAX_TEST_STAMP, rank 0 SIGKILLs itself at the end of epoch E, once."""
import json
import os
import signal
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import parallax_tf as ptf  # noqa: E402
import tf_keras  # noqa: E402


class DieOnce(tf_keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        stamp = os.environ.get("PARALLAX_TEST_STAMP")
        if epoch == int(os.environ.get("PARALLAX_TEST_DIE_AT_EPOCH", "-1")) and not os.path.exists(stamp):
            open(stamp, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


tf_keras.utils.set_random_seed(1)
model = tf_keras.Sequential([tf_keras.layers.Dense(3, input_shape=(4,), name="out")])
model.compile(optimizer="sgd", loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
rng = np.random.RandomState(0)
history = ptf.fit(model, rng.rand(100, 4).astype(np.float32), rng.randint(0, 3, 100), batch_size=16,
                  epochs=int(sys.argv[1]), callbacks=[DieOnce()])
if os.environ.get("HOROVOD_RANK", "0") == "0":
    print("history " + json.dumps({"epoch": history.epoch, **history.history,
                                   "weights": [w.tolist() for w in model.get_weights()]}), flush=True)
