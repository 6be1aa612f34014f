"""ptf.fit for argv[1] epochs (the toolkit's flags after it, e.g. --ckpt_dir); prints the History."""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import parallax_tf as ptf  # noqa: E402
import tf_keras  # noqa: E402

tf_keras.utils.set_random_seed(1)
model = tf_keras.Sequential([tf_keras.layers.Dense(3, input_shape=(4,), name="out")])
model.compile(optimizer="sgd", loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
rng = np.random.RandomState(0)
history = ptf.fit(model, rng.rand(100, 4).astype(np.float32), rng.randint(0, 3, 100), batch_size=16,
                  epochs=int(sys.argv[1]))
print("history " + json.dumps({"epoch": history.epoch, **history.history}), flush=True)
