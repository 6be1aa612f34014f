"""Python objects exchanged between the ranks (Horovod's broadcast_object and allgather_object),
in any thread of a script that disabled eager execution too.

Horovod runs an object exchange eagerly, or in graph mode through the default session, which a
toolkit thread never has. tf.compat.v1.disable_eager_execution() (the first line of many TF1
scripts) makes graph mode the default of every thread that has not entered eager mode itself,
so each exchange enters it."""
from __future__ import annotations

from typing import List, Optional

from parallax_tf.compat import tensorflow as tf_shim


def broadcast(obj, root_rank: int = 0, name: Optional[str] = None):
    """`obj` as the root rank has it, on every rank."""
    import horovod.tensorflow as hvd
    with tf_shim.eager_mode():
        return hvd.broadcast_object(obj, root_rank=root_rank, name=name)


def allgather(obj, name: Optional[str] = None) -> List[object]:
    """Every rank's `obj`, by rank."""
    import horovod.tensorflow as hvd
    with tf_shim.eager_mode():
        return hvd.allgather_object(obj, name=name)
