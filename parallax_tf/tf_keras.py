"""parallax_tf's tf_keras layers (`tf.keras` as Keras 2): `ptf.tf_keras.DynamicEmbedding`, a
dynamic embedding table as a layer (parallax_tf/dynamic/layer.py). tf_keras is imported on first use."""


def __getattr__(name: str):
    from parallax_tf.dynamic.layer import module_attribute
    return module_attribute(globals(), name, "tf_keras")
