"""Models the DSP tests train (tests/jobs/dsp_job.py) and their single-process reference
(tests/test_dsp.py) rebuilds: deep enough to cut into 4 stages, deterministic in (pipeline, batch)."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

import parallax_tf as ptf
from models import cnn, mlp

BATCHES = 20
BATCH = 8


def _keras_mlp():
    """A tf_keras Sequential model trained by the script's own train op with a global step."""
    import tf_keras
    from tf_keras import layers

    def model_fn():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="features")
        y = tf.compat.v1.placeholder(tf.float32, [None], name="labels")
        net = tf_keras.Sequential([layers.Dense(12, activation="tanh", name=f"dense{i}",
                                                kernel_initializer=tf_keras.initializers.GlorotUniform(seed=40 + i))
                                   for i in range(3)] + [layers.Dense(1, name="head", kernel_initializer=tf_keras.initializers.GlorotUniform(seed=49))])
        loss = tf.reduce_mean(tf.square(tf.squeeze(net(x), 1) - y))
        step = tf.compat.v1.train.get_or_create_global_step()
        train_op = tf.compat.v1.train.MomentumOptimizer(0.05, 0.9).minimize(loss, global_step=step)
        return ptf.Model(loss=loss, train_op=train_op)
    return model_fn


# name -> (model_fn, input_fn, optimizer kind and rate, momentum)
MODELS = {
    "mlp_sgd": (mlp.make_model_fn(hidden=12, depth=3, vocab=8, optimizer="sgd", learning_rate=0.1),
                mlp.make_input_fn(vocab=8, batch=BATCH), ("sgd", 0.1)),
    "mlp_momentum": (mlp.make_model_fn(hidden=12, depth=3, vocab=0, optimizer="momentum", learning_rate=0.05),
                     mlp.make_input_fn(vocab=0, batch=BATCH), ("momentum", 0.05)),
    "cnn_momentum": (cnn.make_model_fn(image_size=8, classes=3, conv_channels=(4, 6), fc_units=(16,),
                                       learning_rate=0.02, momentum=0.9),
                     cnn.make_input_fn(image_size=8, classes=3, batch=BATCH), ("momentum", 0.02)),
    "keras_mlp": (_keras_mlp(), mlp.make_input_fn(vocab=0, batch=BATCH), ("momentum", 0.05)),
}


def optimizer(kind_rate):
    kind, rate = kind_rate
    return tf.compat.v1.train.GradientDescentOptimizer(rate) if kind == "sgd" else \
        tf.compat.v1.train.MomentumOptimizer(rate, 0.9)
