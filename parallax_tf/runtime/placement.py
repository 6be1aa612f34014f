"""Where a rewritten graph's ops run, settled after the rewriter.

Four rules, in this order (settle):
- PS state moves onto the worker that serves its host (below), on that task's CPU: variables,
  slots, accumulators and the applies on them stay in host memory, as in Parallax and TF's
  PS training, whatever devices the rank has.
- parallax_tf's compiled ops run on their task's CPU: they have CPU kernels only (BUILD.md).
- On GPU ranks (parallax_tf.devices), every other op of a worker task that the model did not pin
  to a device type runs on that task's GPU:0, the one GPU its process sees. Soft placement puts
  an op without a GPU kernel on the CPU; devices.without_gpu_kernel names those.
- A small constant that ops of other tasks read is made again on each of those tasks, with the
  stateless ops that compute it from constants alone (constants.py): TF sends a tensor that
  crosses tasks in a RecvTensor call of its own every step, constants included (an optimizer's
  hyper-parameters and a slice's bounds beside a shard's apply on its server).

Rewriters place a host's parameter-server state on the logical task /job:ps/task:<host>; no
parallax_tf run starts a `ps` server (only the tf_ps baseline does). The first rank of each host
holds its host's PS state in its own worker server, so that rank reads and updates its host's
shards in-process, not over gRPC on loopback, and each process runs one server. (lm, 2 hosts,
1 Gbit, 60 steps, alternated, two runs each: a separate `ps` server in the same process 3,328 /
3,392 examples/s and 16.2 / 15.7 ms of CPU per step per rank; held by the worker 4,348 / 4,637
and 11.4 / 10.4.)
"""
from __future__ import annotations

from typing import Callable, List

import tensorflow as tf

from parallax_tf import ops as compiled_ops
from parallax_tf.compat import tensorflow as tf_shim
from parallax_tf.runtime.constants import copy_constants_to_readers


def settle(graph, server_ranks: List[int], device_type: str = "CPU") -> None:
    """Applies the four rules: /job:ps/task:k becomes /job:worker/task:<server_ranks[k]>/device:CPU:0;
    compiled ops go to their task's CPU; with `device_type` GPU, a worker's unpinned ops to its GPU:0;
    small constants are made again on the tasks that read them."""
    def placed(device: str, op_type: str) -> str:
        spec = tf.DeviceSpec.from_string(device) if device else None
        if spec is not None and spec.job == "ps":
            return spec.replace(job="worker", task=server_ranks[spec.task or 0], device_type="CPU",
                                device_index=0).to_string()
        if compiled_ops.is_compiled(op_type):
            return (spec or tf.DeviceSpec()).replace(device_type="CPU", device_index=0).to_string()
        if device_type == "GPU" and spec is not None and spec.job == "worker" and spec.device_type is None:
            return spec.replace(device_type="GPU", device_index=0).to_string()
        return device
    map_devices(graph, placed)
    copy_constants_to_readers(graph)


def _task(device: str):
    spec = tf.DeviceSpec.from_string(device) if device else tf.DeviceSpec()
    return spec.job, spec.task


def drop_placements(graph) -> None:
    """Clears every op's job and task (for a session of this process's own devices), keeping
    the device type and index the rules above chose."""
    def local(device: str, op_type: str) -> str:
        spec = tf.DeviceSpec.from_string(device) if device else None
        if spec is None or spec.device_type is None:
            return ""
        return tf.DeviceSpec(device_type=spec.device_type, device_index=spec.device_index).to_string()
    map_devices(graph, local)


def map_devices(graph, new_device: Callable[[str, str], str]) -> None:
    """Sets every op's device to new_device(its device, its type), the ops inside the graph's
    functions too (a while loop's body is placed from those when TF lowers it)."""
    for op in graph.get_operations():
        device = new_device(op.device, op.type)
        if device != op.device:
            tf_shim.set_device(op, device)
    for function in graph.as_graph_def().library.function:
        if all(new_device(node.device, node.op) == node.device for node in function.node_def):
            continue
        for node in function.node_def:
            node.device = new_device(node.device, node.op)
        tf_shim.replace_graph_function(graph, function.signature.name, function)
