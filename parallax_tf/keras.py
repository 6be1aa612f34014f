"""parallax_tf's Keras 3 layers (`import keras`): `ptf.keras.DynamicEmbedding`, a dynamic
embedding table as a layer (parallax_tf/dynamic/layer.py). Keras is imported on first use."""


def __getattr__(name: str):
    from parallax_tf.dynamic.layer import module_attribute
    return module_attribute(globals(), name, "keras")
