"""parallax_tf's Keras 3 layers (`import keras`): `ptf.keras.DynamicEmbedding`, a dynamic
embedding table as a layer (parallax_tf/dynamic/layer.py). Keras is imported on first use."""


def __getattr__(name: str):
    if name == "DynamicEmbedding":
        import keras
        from parallax_tf.dynamic.layer import layer_class
        made = globals()[name] = keras.saving.register_keras_serializable("parallax_tf")(
            layer_class(keras.layers.Layer, __name__))
        return made
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
