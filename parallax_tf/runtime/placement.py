"""Where a rewritten graph's ops run, settled after the rewriter.

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


def host_servers_on_workers(graph, server_ranks: List[int]) -> None:
    """Moves every op on /job:ps/task:k onto /job:worker/task:<server_ranks[k]>."""
    def moved(device: str) -> str:
        spec = tf.DeviceSpec.from_string(device) if device else None
        if spec is None or spec.job != "ps":
            return device
        return spec.replace(job="worker", task=server_ranks[spec.task or 0]).to_string()
    map_devices(graph, moved)


def drop_placements(graph) -> None:
    """Clears every op's device (for a session of this process's own devices)."""
    map_devices(graph, lambda device: "")


def map_devices(graph, new_device: Callable[[str], str]) -> None:
    """Sets every op's device to new_device(its device), the ops inside the graph's functions
    too (a while loop's body is placed from those when TF lowers it)."""
    from tensorflow.python.client import pywrap_tf_session as c_api
    for op in graph.get_operations():
        device = new_device(op.device)
        if device != op.device:
            op._set_device(device)
    for function in graph.as_graph_def().library.function:
        if all(new_device(node.device) == node.device for node in function.node_def):
            continue
        for node in function.node_def:
            node.device = new_device(node.device)
        name = function.signature.name
        c_api.TF_GraphRemoveFunction(graph._c_graph, name)
        imported = c_api.TF_FunctionImportFunctionDef(function.SerializeToString())
        try:
            c_api.TF_GraphCopyFunction(graph._c_graph, imported, None)
        finally:
            c_api.TF_DeleteFunction(imported)
