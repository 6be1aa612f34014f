"""The two ranks of `python -m parallax_tf check`: each starts its server as a training run does,
then they sum a tensor with Horovod and rank 1 adds to a variable on rank 0's server and reads
it back. Prints nothing on success; exits 1 naming what failed."""
import sys

import numpy as np
import tensorflow as tf

from parallax_tf import devices
from parallax_tf import threads as pool_threads
from parallax_tf.runtime import cluster as cluster_lib


def main() -> int:
    import horovod.tensorflow as hvd
    # ranks may share a GPU here: this checks the servers and collectives, not memory
    cluster = cluster_lib.start_cluster(None, None, device_request=devices.DeviceRequest(share=True))
    topo = cluster.topology
    total = hvd.allreduce(tf.constant([float(topo.rank + 1)]), op=hvd.Sum, name="parallax_check_sum")
    if float(total.numpy()[0]) != 3.0:
        print(f"allreduce gave {total.numpy()} instead of [3.]", file=sys.stderr)
        return 1
    graph = tf.Graph()
    with graph.as_default():
        with tf.device("/job:worker/task:0"):
            counter = tf.compat.v1.get_variable("parallax_check_counter", [], tf.float32,
                                                initializer=tf.compat.v1.zeros_initializer(), use_resource=True)
        with tf.device(topo.worker_device):
            add = counter.assign_add(1.0)
    config = pool_threads.ProcessConfig().proto(allow_soft_placement=True, operation_timeout_in_ms=60000)
    config.device_filters.extend([topo.worker_device, "/job:worker/task:0"])
    with tf.compat.v1.Session(cluster.target, graph=graph, config=config) as sess:
        if topo.rank == 0:
            sess.run(counter.initializer)
        hvd.allreduce(tf.constant(0.0), name="parallax_check_initialised")
        got = sess.run(add) if topo.rank == 1 else None
        hvd.allreduce(tf.constant(0.0), name="parallax_check_added")
    if topo.rank == 1 and not np.isclose(got, 1.0):
        print(f"the round trip to rank 0's server read {got} instead of 1.0", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
