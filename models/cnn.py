"""VGG-like CNN on small generated images with a large fully connected head (the dense model).

Convolutions are tiny; the FC head (flatten -> 1024 -> 1024 -> classes) holds almost all the
bytes, the situation where FC layers dominate communication. `--cnn_keras` builds it with
tf_keras layers and batch norm, trained by the script's own train op.

    python -m models.cnn --np 2 --steps 60
    python -m models.cnn --np 2 --steps 60 --cnn_keras
"""
from __future__ import annotations

from typing import Sequence

import parallax_tf as ptf  # before TF (keeps its import-time logs quiet); registers --steps, --np, ...
import tensorflow as tf
from absl import app, flags

from models import data, run_and_report

flags.DEFINE_integer("cnn_image_size", 16, "Height and width of the generated images.")
flags.DEFINE_integer("cnn_classes", 10, "Number of classes.")
flags.DEFINE_list("cnn_conv_channels", ["16", "32"], "Channels per conv block (two 3x3 convs + 2x2 max pool each).")
flags.DEFINE_list("cnn_fc_units", ["1024", "1024"], "Widths of the hidden fully connected layers.")
flags.DEFINE_integer("cnn_batch", 32, "Images per rank per step.")
flags.DEFINE_float("cnn_learning_rate", 0.01, "Momentum optimizer learning rate.")
flags.DEFINE_float("cnn_momentum", 0.9, "Momentum.")
flags.DEFINE_float("cnn_noise", 1.0, "Standard deviation of the noise added to the class patterns.")
flags.DEFINE_float("cnn_label_noise", 0.0, "Fraction of labels drawn uniformly at random: the held-out loss then "
                   "has the floor models.data.label_entropy above 0, so strategies can be compared at convergence.")
flags.DEFINE_bool("cnn_keras", False, "Build the CNN with tf_keras (Keras 2) layers, batch norm after each "
                  "conv, and the script's own train op (LR decay on the global step, model.updates).")
FLAGS = flags.FLAGS

DEFAULTS = dict(image_size=16, classes=10, conv_channels=(16, 32), fc_units=(1024, 1024), batch=32,
                learning_rate=0.01, momentum=0.9, noise=1.0)
CHANNELS = 3


def conv_block(x, index: int, channels: int):
    """Two 3x3 conv + ReLU layers, then a 2x2 max pool, as in VGG."""
    for layer in range(2):
        with tf.compat.v1.variable_scope(f"conv{index}_{layer + 1}"):
            kernel = tf.compat.v1.get_variable(
                "kernel", [3, 3, int(x.shape[-1]), channels],
                initializer=tf.compat.v1.variance_scaling_initializer(2.0, seed=100 + 10 * index + layer))
            bias = tf.compat.v1.get_variable("bias", [channels], initializer=tf.compat.v1.zeros_initializer())
            x = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, kernel, strides=1, padding="SAME"), bias))
    return tf.nn.max_pool2d(x, ksize=2, strides=2, padding="VALID")


def dense(x, name: str, units: int, seed: int, relu: bool):
    with tf.compat.v1.variable_scope(name):
        kernel = tf.compat.v1.get_variable(
            "kernel", [int(x.shape[-1]), units],
            initializer=tf.compat.v1.variance_scaling_initializer(2.0 if relu else 1.0, seed=seed))
        bias = tf.compat.v1.get_variable("bias", [units], initializer=tf.compat.v1.zeros_initializer())
        y = tf.nn.bias_add(tf.matmul(x, kernel), bias)
    return tf.nn.relu(y) if relu else y


def make_model_fn(image_size: int = DEFAULTS["image_size"], classes: int = DEFAULTS["classes"],
                  conv_channels: Sequence[int] = DEFAULTS["conv_channels"],
                  fc_units: Sequence[int] = DEFAULTS["fc_units"],
                  learning_rate: float = DEFAULTS["learning_rate"], momentum: float = DEFAULTS["momentum"]):
    """model_fn() building the CNN; placeholders "images" float32 [batch, size, size, 3], "labels" int64."""
    if image_size % 2 ** len(conv_channels):
        raise ValueError(f"image_size {image_size} must be divisible by 2**{len(conv_channels)} (one pool per block)")

    def model_fn():
        images = tf.compat.v1.placeholder(tf.float32, [None, image_size, image_size, CHANNELS], name="images")
        labels = tf.compat.v1.placeholder(tf.int64, [None], name="labels")
        x = images
        for index, channels in enumerate(conv_channels, start=1):
            x = conv_block(x, index, int(channels))
        x = tf.reshape(x, [-1, int(x.shape[1]) * int(x.shape[2]) * int(x.shape[3])])
        for index, units in enumerate(fc_units, start=1):
            x = dense(x, f"fc{index}", int(units), seed=200 + index, relu=True)
        logits = dense(x, "logits", classes, seed=299, relu=False)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
        return ptf.Model(loss=loss, optimizer=tf.compat.v1.train.MomentumOptimizer(learning_rate, momentum))
    return model_fn


def make_keras_model_fn(image_size: int = DEFAULTS["image_size"], classes: int = DEFAULTS["classes"],
                        conv_channels: Sequence[int] = DEFAULTS["conv_channels"],
                        fc_units: Sequence[int] = DEFAULTS["fc_units"],
                        learning_rate: float = DEFAULTS["learning_rate"], momentum: float = DEFAULTS["momentum"]):
    """The same CNN as a tf_keras model with batch norm, written as a single-device TF1 script
    writes it: the model's own global step, an LR schedule on it, and a train op that runs the
    batch-norm updates (model.updates) before minimize."""
    import tf_keras
    from tf_keras import layers

    def model_fn():
        images = tf.compat.v1.placeholder(tf.float32, [None, image_size, image_size, CHANNELS], name="images")
        labels = tf.compat.v1.placeholder(tf.int64, [None], name="labels")
        stack = []
        for index, channels in enumerate(conv_channels, start=1):
            for layer in range(2):
                stack += [layers.Conv2D(int(channels), 3, padding="same", use_bias=False, name=f"conv{index}_{layer + 1}",
                                        kernel_initializer=tf_keras.initializers.HeNormal(seed=100 + 10 * index + layer)),
                          layers.BatchNormalization(momentum=0.9, name=f"bn{index}_{layer + 1}"), layers.ReLU()]
            stack.append(layers.MaxPooling2D(2))
        stack.append(layers.Flatten())
        for index, units in enumerate(fc_units, start=1):
            stack.append(layers.Dense(int(units), activation="relu", name=f"fc{index}",
                                      kernel_initializer=tf_keras.initializers.HeNormal(seed=200 + index)))
        stack.append(layers.Dense(classes, name="logits", kernel_initializer=tf_keras.initializers.GlorotUniform(seed=299)))
        net = tf_keras.Sequential(stack, name="cnn")
        logits = net(images, training=True)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
        step = tf.compat.v1.train.get_or_create_global_step()
        rate = tf.compat.v1.train.exponential_decay(learning_rate, step, decay_steps=100, decay_rate=0.9)
        with tf.control_dependencies(net.updates):
            train_op = tf.compat.v1.train.MomentumOptimizer(rate, momentum).minimize(loss, global_step=step)
        return ptf.Model(loss=loss, train_op=train_op)
    return model_fn


def make_input_fn(image_size: int = DEFAULTS["image_size"], classes: int = DEFAULTS["classes"],
                  batch: int = DEFAULTS["batch"], noise: float = DEFAULTS["noise"], seed: int = 0,
                  label_noise: float = 0.0):
    """input_fn(ctx) -> {"images", "labels"}: per-class patterns plus noise (same patterns on every
    rank); a label_noise fraction of the labels drawn at random (see data.pattern_images)."""
    def input_fn(ctx):
        rng = data.batch_rng(seed, ctx.rank, ctx.step)
        images, labels = data.pattern_images(rng, batch, classes, image_size, image_size, CHANNELS, seed, noise,
                                             label_noise)
        return {"images": images, "labels": labels}
    return input_fn


model_fn = make_model_fn()
input_fn = make_input_fn()


def from_flags():
    """(model_fn, input_fn) with the sizes the --cnn_* flags give (their defaults: DEFAULTS)."""
    make = make_keras_model_fn if FLAGS.cnn_keras else make_model_fn
    model = make(image_size=FLAGS.cnn_image_size, classes=FLAGS.cnn_classes,
                 conv_channels=[int(c) for c in FLAGS.cnn_conv_channels],
                 fc_units=[int(u) for u in FLAGS.cnn_fc_units],
                 learning_rate=FLAGS.cnn_learning_rate, momentum=FLAGS.cnn_momentum)
    inputs = make_input_fn(image_size=FLAGS.cnn_image_size, classes=FLAGS.cnn_classes, batch=FLAGS.cnn_batch,
                           noise=FLAGS.cnn_noise, seed=FLAGS.seed, label_noise=FLAGS.cnn_label_noise)
    return model, inputs


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    run_and_report("cnn", *from_flags())


if __name__ == "__main__":
    app.run(main)
