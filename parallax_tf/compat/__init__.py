"""The private names of TensorFlow, tf_keras and Horovod that the toolkit uses, one module per
dependency (tensorflow.py, tf_keras.py, horovod.py). Nothing else in parallax_tf/ or rewriters/
reaches a private name of theirs (tests/test_compat.py checks it, and that each pinned name
still resolves on the installed versions).

The bottom layer: these modules import no other parallax_tf module, and importing the package
imports no dependency (each shim imports its dependency inside the functions that use it)."""
