"""parallax_tf's tf_keras layers (`tf.keras` as Keras 2): `ptf.tf_keras.DynamicEmbedding`, a
dynamic embedding table as a layer (parallax_tf/dynamic/layer.py). tf_keras is imported on first use."""


def __getattr__(name: str):
    if name == "DynamicEmbedding":
        import tf_keras
        from parallax_tf.dynamic.layer import layer_class
        made = globals()[name] = tf_keras.utils.register_keras_serializable("parallax_tf")(
            layer_class(tf_keras.layers.Layer, __name__))
        return made
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
