"""A Keras compile/fit script that imports parallax_tf but never calls parallax_tf.run."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import parallax_tf  # noqa: E402,F401
import tf_keras  # noqa: E402

model = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(4,))])
model.compile("sgd", "mse")
model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0)
