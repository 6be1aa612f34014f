"""One GPU per rank: the choice (a pure function of the host and the GPUs TensorFlow lists), the
session config it makes, and where the rewritten graphs of hybrid, ps_plus, stanza and dsp put
their ops on a job of 2 hosts x 2 GPU ranks (built, not run: this machine has no GPU)."""
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import kernel_def_pb2, types_pb2

from parallax_tf import devices, graph_walk
from parallax_tf import ops as compiled_ops
from parallax_tf.errors import ConfigError
from parallax_tf.runtime import constants, placement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Request = devices.DeviceRequest


@pytest.mark.parametrize("local_rank,local_size,listed,request_,visible,want", [
    (1, 2, 2, Request(), None, devices.DeviceChoice(gpu=1)),                      # rank r on GPU r
    (0, 1, 8, Request(), None, devices.DeviceChoice(gpu=0)),
    (1, 2, 2, Request(memory_fraction=0.5), None, devices.DeviceChoice(gpu=1, memory_fraction=0.5)),
    (1, 2, 0, Request(), None, devices.DeviceChoice()),                            # no GPU listed: the CPU
    (1, 2, 2, Request(gpus_per_rank=0), None, devices.DeviceChoice()),             # asked for the CPU
    (3, 4, 2, Request(share=True), None, devices.DeviceChoice(gpu=1, memory_fraction=0.45, sharing=2)),
    (2, 3, 2, Request(share=True), None, devices.DeviceChoice(gpu=0, memory_fraction=0.45, sharing=2)),
    (3, 4, 1, Request(), "5", devices.DeviceChoice(gpu=0)),      # a scheduler gave each rank its one GPU
])
def test_each_rank_takes_the_gpu_of_its_local_rank(local_rank, local_size, listed, request_, visible, want):
    assert devices.choose(local_rank, local_size, listed, request_, visible) == want


@pytest.mark.parametrize("local_size,listed,request_,visible,message", [
    (4, 2, Request(), None, r"4 ranks on this host but TensorFlow lists 2 GPU\(s\): start at most 2 rank\(s\) per host "
                            r"\(--np, or horovodrun -H host:2\), pass --share_gpus .* or --gpus_per_rank=0"),
    (2, 1, Request(), "0,1", r"2 ranks on this host but TensorFlow lists 1 GPU"),
    (1, 0, Request(gpus_per_rank=1), None, r"--gpus_per_rank=1 but TensorFlow lists no GPU on this host"),
    (1, 1, Request(gpus_per_rank=2), None, r"--gpus_per_rank=2: a rank trains a single-device model on one GPU"),
    (1, 1, Request(memory_fraction=1.5), None, r"--gpu_memory_fraction=1.5: pass a fraction in \(0, 1\]"),
])
def test_a_choice_that_cannot_work_is_one_clear_error(local_size, listed, request_, visible, message):
    with pytest.raises(ConfigError, match=message):
        devices.choose(0, local_size, listed, request_, visible)


def test_the_session_config_shows_the_rank_its_gpu_only():
    config = tf.compat.v1.ConfigProto()
    devices.configure(config, devices.DeviceChoice(gpu=3))
    assert config.gpu_options.visible_device_list == "3" and config.gpu_options.allow_growth
    config = tf.compat.v1.ConfigProto()
    devices.configure(config, devices.DeviceChoice(gpu=1, memory_fraction=0.45, sharing=2))
    assert config.gpu_options.per_process_gpu_memory_fraction == pytest.approx(0.45)
    assert not config.gpu_options.allow_growth
    config = tf.compat.v1.ConfigProto()
    devices.configure(config, devices.DeviceChoice())
    assert config.device_count["GPU"] == 0 and not config.gpu_options.visible_device_list
    config = tf.compat.v1.ConfigProto()
    devices.configure(config, None)           # no choice yet (a plan-only run): take memory as needed
    assert config.gpu_options.allow_growth and not config.device_count


def test_every_rank_agrees_on_its_kind_of_device():
    def peer(rank, host, device, gpu):
        return {"rank": rank, "host": host, "device": device, "gpu": gpu}
    devices.check_agreement([peer(0, "a", "GPU", "0"), peer(1, "a", "GPU", "1"), peer(2, "b", "GPU", "0")], False)
    with pytest.raises(ConfigError, match=r"ranks compute on different kinds of device: rank 2 on b on the CPU, "
                                          r"rank 0 on a on the GPU; .*--gpus_per_rank=0"):
        devices.check_agreement([peer(0, "a", "GPU", "0"), peer(1, "a", "GPU", "1"), peer(2, "b", "CPU", None)], False)
    twice = [peer(0, "a", "GPU", "0"), peer(1, "a", "GPU", "0")]
    with pytest.raises(ConfigError, match=r"ranks 0 and 1 on a both see only GPU 0 .*--share_gpus"):
        devices.check_agreement(twice, False)
    devices.check_agreement(twice, True)
    assert devices.physical_id(devices.DeviceChoice(gpu=0), "4") == "4"
    assert devices.physical_id(devices.DeviceChoice(gpu=1), None) == "1"


def test_the_plan_says_where_collectives_run():
    gpu = devices.DeviceChoice(gpu=0)
    assert devices.summary(devices.DeviceChoice(), True, True) is None       # a CPU plan reads as always
    assert devices.summary(gpu, True, True).endswith("Horovod collectives NCCL on the GPU")
    assert "through host memory (Horovod built without NCCL" in devices.summary(gpu, False, False)


def test_ops_without_a_gpu_kernel_for_their_attributes_are_named():
    def kernel(**allowed):
        found = kernel_def_pb2.KernelDef(device_type="GPU")
        for name, types in allowed.items():
            constraint = found.constraint.add(name=name)
            constraint.allowed_values.list.type.extend(types)
        return found
    registry = {"Const": [kernel()], "Mul": [kernel(T=[types_pb2.DT_FLOAT])], "AsString": []}
    graph = tf.Graph()
    with graph.as_default():
        with tf.device("/job:worker/task:0/device:GPU:0"):
            a = tf.constant(1.0)
            tf.strings.as_string(a * 2.0)
            tf.constant(3) * tf.constant(4)       # int32: no GPU kernel of these
        with tf.device("/job:worker/task:0/device:CPU:0"):
            tf.strings.as_string(a)               # placed on the CPU already: not a fallback
    assert devices.without_gpu_kernel(graph.get_operations(), lambda t: registry.get(t, [])) == {
        "AsString": 1, "Mul": 1}


def test_every_compiled_op_is_known_as_one():
    registered = [name for path in glob.glob(os.path.join(ROOT, "parallax_tf", "ops", "*.cc"))
                  for name in re.findall(r'REGISTER_OP\("(\w+)"\)', open(path).read())]
    assert len(registered) >= 10 and all(compiled_ops.is_compiled(name) for name in registered)


def test_placement_rules_on_a_small_graph():
    graph = tf.Graph()
    with graph.as_default():
        with tf.device("/job:ps/task:1"):
            table = tf.compat.v1.get_variable("table", [2], use_resource=True)
        with tf.device("/job:worker/task:1"):
            doubled = table.read_value() * 2.0
            with tf.device("/device:CPU:0"):
                pinned = doubled + 1.0                 # the model's own pin stays
    placement.settle(graph, server_ranks=[0, 2], device_type="GPU")
    assert graph.get_operation_by_name("table").device == "/job:worker/task:2/device:CPU:0"
    assert doubled.op.device == "/job:worker/task:1/device:GPU:0"
    assert pinned.op.device == "/job:worker/task:1/device:CPU:0"
    placement.drop_placements(graph)                  # a session of the process's own devices
    assert (doubled.op.device, pinned.op.device) == ("/device:GPU:0", "/device:CPU:0")



def test_small_constants_read_on_another_task_are_made_there():
    graph = tf.Graph()
    with graph.as_default():
        with tf.device("/job:worker/task:0"):
            step = tf.constant([0.5, 0.25], name="step")
            big = tf.constant(np.zeros(32 * 1024, np.float32), name="big")     # 128 KB: sent, not copied
            waits = tf.no_op()
            with tf.control_dependencies([waits]):
                gated = tf.constant(2.0, name="gated")
            rate = tf.constant(0.1, name="rate")
            term = tf.add(tf.constant(0.01), tf.constant(1.0) / (2.0 * rate), name="term")  # FTRL's l2 + beta/(2 lr)
            long = rate
            for _ in range(constants.MAX_COPIED_OPS):
                long = long * 1.0
        with tf.device("/job:ps/task:1"):
            table = tf.compat.v1.get_variable("table", [2], use_resource=True)
            scaled = table.read_value() * step * gated
            applied = table.read_value() * term
            far = table.read_value() * long
            summed = tf.reduce_sum(big) + tf.reduce_sum(scaled)
        with tf.device("/job:worker/task:0/device:GPU:0"):
            local = step * 3.0                              # the same task: no copy
    placement.settle(graph, server_ranks=[0, 2])
    copy = scaled.op.inputs[0].op.inputs[1].op
    assert copy is not step.op and copy.type == "Const"
    assert copy.device == "/job:worker/task:2/device:CPU:0"
    assert (tf.make_ndarray(copy.get_attr("value")) == [0.5, 0.25]).all()
    assert scaled.op.inputs[1].op is gated.op                            # waits on a control input: stays
    assert summed.op.inputs[0].op.inputs[0].op is big.op
    assert local.op.inputs[0].op is step.op
    computed = applied.op.inputs[1].op                                   # made there from its own constants
    assert computed is not term.op and computed.type == "AddV2"
    made_there = graph_walk.ancestors(computed)
    assert {op.device for op in made_there} == {"/job:worker/task:2/device:CPU:0"}
    assert {op.type for op in made_there} == {"AddV2", "RealDiv", "Mul", "Const"} and rate.op not in made_there
    assert term.op.device == "/job:worker/task:0"
    assert far.op.inputs[1].op is long.op              # more ops than one copy makes: sent, as TF would
    assert placement.copy_constants_to_readers(graph) == 0               # once settled, nothing left to copy
    placement.drop_placements(graph)
    with tf.compat.v1.Session(graph=graph, config=tf.compat.v1.ConfigProto(allow_soft_placement=True)) as sess:
        assert sess.run(computed.outputs[0]) == sess.run(term) == np.float32(0.01) + np.float32(1.0) / np.float32(0.2)

@pytest.fixture(scope="module")
def placed():
    out = os.path.join(tempfile.mkdtemp(prefix="ptf-placement-"), "placed.json")
    proc = subprocess.run([sys.executable, "tests/jobs/placement_job.py", out], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.load(open(out))


SERVER_RANKS = {0, 2}          # the first rank of each of the 2 hosts holds its host's PS state
DEVICE = re.compile(r"^/job:worker/task:(\d+)/device:(CPU|GPU):(\d+|\*)$")


@pytest.mark.parametrize("strategy", ["hybrid", "ps_plus", "stanza", "dsp"])
def test_gpu_ranks_compute_on_their_gpu_and_keep_ps_state_on_the_cpu(placed, strategy):
    plan = placed[strategy]["plan"]
    on_servers = {s["name"] for v in plan["variables"] if v["shards"] for s in v["shards"]}
    replicated = {v["name"] for v in plan["variables"] if not v["shards"]}
    assert bool(on_servers) == (strategy in ("hybrid", "ps_plus"))
    for rank, ops in enumerate(placed[strategy]["ranks"]):
        placed_ops = [(name, op_type, DEVICE.match(device)) for name, op_type, device in ops if device]
        assert all(match for _, _, match in placed_ops), [d for _, _, d in ops if d and not DEVICE.match(d)][:5]
        where = {name: (int(m.group(1)), m.group(2)) for name, _, m in placed_ops}
        for name, op_type, match in placed_ops:
            task, kind = int(match.group(1)), match.group(2)
            if compiled_ops.is_compiled(op_type):
                assert kind == "CPU", (rank, name)
            elif kind == "CPU" and task not in SERVER_RANKS:
                assert op_type == "FIFOQueueV2", (rank, name, op_type)    # a rewriter's host-memory queue
            if kind == "GPU":
                assert match.group(3) == "0"      # the one GPU the task's process sees
        for shard in on_servers:                  # PS state on a server rank's CPU
            assert where[shard][1] == "CPU" and where[shard][0] in SERVER_RANKS, (rank, shard, where[shard])
        variables = {name for name, op_type, _ in placed_ops if op_type == "VarHandleOp"}
        for name in replicated & variables:       # the model's own replicas on the rank's GPU
            assert where[name] == (rank, "GPU"), (rank, name, where[name])
        assert sum(kind == "GPU" and task == rank for task, kind in where.values()) > 100
    if strategy == "stanza":     # the FC node's layers are on its own GPU
        fc_rank = plan["section"]["fc_ranks"][0]
        assert where_of(placed[strategy]["ranks"][fc_rank], "fc1/kernel") == f"/job:worker/task:{fc_rank}/device:GPU:0"


def where_of(ops, name):
    return next(device for op_name, _, device in ops if op_name == name)


def test_a_cpu_job_is_placed_as_before(placed):
    """A CPU rank's ops keep the worker task without a device type, as TF places them; PS state and
    compiled ops are pinned to the CPU either way."""
    ops = placed["hybrid_cpu"]["ranks"][0]
    assert not any("GPU" in device for _, _, device in ops)
    assert sum(device == "/job:worker/task:1" for _, _, device in ops) > 100
    assert where_of(ops, "emb") == "/job:worker/task:0/device:CPU:0"


@pytest.mark.parametrize("listed,forced,device,package", [
    ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)", None, "gpu", "tensorflow[and-cuda]==2.21.*"),
    ("", None, "cpu", "tensorflow-cpu==2.21.*"),                  # nvidia-smi there, no GPU listed
    (None, None, "cpu", "tensorflow-cpu==2.21.*"),                # no nvidia-smi at all
    ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)", "cpu", "cpu", "tensorflow-cpu==2.21.*"),
    (None, "gpu", "gpu", "tensorflow[and-cuda]==2.21.*"),
])
def test_setup_installs_tensorflow_with_cuda_where_nvidia_smi_lists_a_gpu(tmp_path, listed, forced, device, package):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "cat", "grep", "dirname"):
        os.symlink(subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip(), bin_dir / tool)
    if listed is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '%s\\n' '{listed}'\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {"PATH": str(bin_dir), **({"PARALLAX_DEVICE": forced} if forced else {})}
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "setup.sh"), "--plan"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert f"device: {device} " in proc.stdout and f"tensorflow: {package}\n" in proc.stdout
    assert ("NCCL" in proc.stdout) == (device == "gpu")


def test_setup_refuses_an_unknown_device(tmp_path):
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "setup.sh"), "--plan"], capture_output=True, text=True,
                          env=dict(os.environ, PARALLAX_DEVICE="tpu"), timeout=60)
    assert proc.returncode == 2
    assert "PARALLAX_DEVICE=tpu: set it to gpu or cpu, or leave it unset" in proc.stderr
