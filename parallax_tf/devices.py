"""Which device each rank computes on: one GPU per rank, as Horovod asks of its users.

A rank's process sees one GPU only, the one whose index is the rank's local rank on its host
(`gpu_options.visible_device_list`), so its graph's GPU ops run on `/device:GPU:0` of its own
worker task and TensorFlow does not take memory on the other ranks' GPUs. Memory grows as the
rank needs it unless --gpu_memory_fraction caps it. With more ranks than GPUs on a host the job
stops with one message, unless --share_gpus lets the ranks take turns (rank r on GPU r mod G,
each with 1/k of its memory). --gpus_per_rank=0, or a machine where TensorFlow lists no GPU,
keeps every rank on the CPU.

What stays on the CPU whatever the rank has (runtime.placement): parameter-server state, its
optimizer slots, accumulators and applies (as Parallax and TF's own PS training keep them), and
parallax_tf's compiled ops, which have CPU kernels only. The choice is made once per process,
before its first server or session, and every ConfigProto parallax_tf makes carries it
(threads.config).

This module imports no TensorFlow: the choice is a pure function of the host's topology and the
GPUs TensorFlow lists, so it is tested, and checked on a GPU machine, without a GPU build.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable, Dict, Iterable, List, Optional

from parallax_tf.errors import ConfigError

CPU, GPU = "CPU", "GPU"
SHARED_MEMORY_HEADROOM = 0.9     # of a shared GPU's memory, split between its ranks (CUDA contexts need the rest)


@dataclasses.dataclass(frozen=True)
class DeviceChoice:
    """One rank's device: `gpu` is the host's GPU index it sees as GPU:0 (None: the CPU only)."""
    gpu: Optional[int] = None
    memory_fraction: Optional[float] = None   # None: memory grows as needed
    sharing: int = 1                          # ranks on this GPU (--share_gpus)

    @property
    def device_type(self) -> str:
        return CPU if self.gpu is None else GPU

    def describe(self) -> str:
        if self.gpu is None:
            return "CPU"
        memory = "memory as needed" if self.memory_fraction is None else f"{self.memory_fraction:.0%} of its memory"
        shared = f", shared by {self.sharing} ranks" if self.sharing > 1 else ""
        return f"GPU {self.gpu} ({memory}{shared})"


@dataclasses.dataclass(frozen=True)
class DeviceRequest:
    """What the user asked for: --gpus_per_rank (None: 1 where GPUs are listed, else 0),
    --gpu_memory_fraction (None: as needed), --share_gpus."""
    gpus_per_rank: Optional[int] = None
    memory_fraction: Optional[float] = None
    share: bool = False

    def check(self) -> None:
        if self.gpus_per_rank not in (None, 0, 1):
            raise ConfigError(f"--gpus_per_rank={self.gpus_per_rank}: a rank trains a single-device model on one "
                              "GPU; pass 1 (the default where TensorFlow lists GPUs) or 0 (the CPU)")
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ConfigError(f"--gpu_memory_fraction={self.memory_fraction}: pass a fraction in (0, 1]")


def choose(local_rank: int, local_size: int, gpus_listed: int, request: DeviceRequest = DeviceRequest(),
           cuda_visible: Optional[str] = None) -> DeviceChoice:
    """The device of the rank `local_rank` of `local_size` on a host where TensorFlow lists
    `gpus_listed` GPUs, for what the user asked (`request`). `cuda_visible`: the rank's
    CUDA_VISIBLE_DEVICES; a scheduler that gives each rank one GPU that way (Slurm's
    --gpus-per-task) has already made the choice, so the rank takes the one GPU it sees."""
    request.check()
    gpus_per_rank, memory_fraction, share = request.gpus_per_rank, request.memory_fraction, request.share
    if gpus_per_rank == 0 or (gpus_per_rank is None and gpus_listed == 0):
        return DeviceChoice()
    if gpus_listed == 1 and local_size > 1 and cuda_visible and len(cuda_visible.split(",")) == 1:
        return DeviceChoice(gpu=0, memory_fraction=memory_fraction)
    if gpus_listed == 0:
        raise ConfigError("--gpus_per_rank=1 but TensorFlow lists no GPU on this host: install TensorFlow with "
                          "CUDA (BUILD.md, 'GPUs'), check CUDA_VISIBLE_DEVICES, or pass --gpus_per_rank=0")
    if local_size > gpus_listed and not share:
        raise ConfigError(f"{local_size} ranks on this host but TensorFlow lists {gpus_listed} GPU(s): start at most "
                          f"{gpus_listed} rank(s) per host (--np, or horovodrun -H host:{gpus_listed}), pass "
                          "--share_gpus to let ranks share a GPU, or --gpus_per_rank=0 to train on the CPU")
    sharing = math.ceil(local_size / gpus_listed) if share else 1
    if sharing > 1 and memory_fraction is None:
        memory_fraction = round(SHARED_MEMORY_HEADROOM / sharing, 4)
    return DeviceChoice(gpu=local_rank % gpus_listed, memory_fraction=memory_fraction, sharing=sharing)


def physical_id(choice: DeviceChoice, cuda_visible: Optional[str]) -> Optional[str]:
    """The host's name for the rank's GPU: its CUDA_VISIBLE_DEVICES entry where that is set."""
    if choice.gpu is None:
        return None
    entries = [e.strip() for e in cuda_visible.split(",")] if cuda_visible else []
    return entries[choice.gpu] if choice.gpu < len(entries) else str(choice.gpu)


def check_agreement(peers: List[dict], share: bool) -> None:
    """Every rank computes on the same kind of device, and no two ranks of a host on one GPU
    unless --share_gpus. `peers`: each rank's {"rank", "host", "device", "gpu"} (the GPU's
    physical_id)."""
    kinds = {p["device"] for p in peers}
    if len(kinds) > 1:
        first = {kind: next(p for p in peers if p["device"] == kind) for kind in sorted(kinds)}
        raise ConfigError("ranks compute on different kinds of device: " + ", ".join(
            f"rank {p['rank']} on {p['host']} on the {kind}" for kind, p in first.items())
            + "; give every host GPUs (and TensorFlow with CUDA), or pass --gpus_per_rank=0 to train on CPUs")
    if share:
        return
    seen: Dict[tuple, int] = {}
    for p in peers:
        if p["gpu"] is None:
            continue
        key = (p["host"], p["gpu"])
        if key in seen:
            raise ConfigError(f"ranks {seen[key]} and {p['rank']} on {p['host']} both see only GPU {p['gpu']} "
                              "(CUDA_VISIBLE_DEVICES): give each rank its own GPU, or pass --share_gpus")
        seen[key] = p["rank"]


def summary(choice: DeviceChoice, nccl_built: bool, cuda_built: bool) -> Optional[str]:
    """The plan's devices line on GPU ranks (None on the CPU, whose plan reads as it always has)."""
    if choice.gpu is None:
        return None
    collectives = "NCCL on the GPU" if nccl_built and cuda_built else \
        "through host memory (Horovod built without NCCL: BUILD.md, 'GPUs')"
    ranks = f"{choice.sharing} ranks per GPU, --share_gpus: rank r of a host on its GPU r mod G" \
        if choice.sharing > 1 else "one GPU per rank: rank r of a host on its GPU r"
    return f"{ranks}; PS state and parallax_tf's ops on the CPU; Horovod collectives {collectives}"


def configure(config, choice: Optional[DeviceChoice]) -> None:
    """Fills a ConfigProto with the choice. Before any choice (a plan-only run, a tool's own
    session) memory grows as needed, so a process that lists GPUs does not take them all."""
    if choice is None:
        config.gpu_options.allow_growth = True
        return
    if choice.gpu is None:
        config.device_count["GPU"] = 0
        return
    config.gpu_options.visible_device_list = str(choice.gpu)
    if choice.memory_fraction is None:
        config.gpu_options.allow_growth = True
    else:
        config.gpu_options.per_process_gpu_memory_fraction = choice.memory_fraction


def listed_gpus() -> int:
    """The GPUs TensorFlow lists in this process (CUDA_VISIBLE_DEVICES applies; a CPU build: 0)."""
    import tensorflow as tf
    return len(tf.config.list_physical_devices(GPU))


# ---- ops that fall back to the CPU --------------------------------------------------------------

def gpu_kernel_lookup() -> Callable[[str], list]:
    """op type -> the KernelDefs this TensorFlow registers for it on the GPU."""
    from parallax_tf.compat import tensorflow as tf_shim
    cache: Dict[str, list] = {}

    def lookup(op_type: str) -> list:
        if op_type not in cache:
            try:
                found = tf_shim.registered_kernels(op_type)
            except Exception:   # noqa: BLE001  (an op TF does not know, e.g. a library's own)
                found = []
            cache[op_type] = [k for k in found if k.device_type == GPU]
        return cache[op_type]
    return lookup


def without_gpu_kernel(ops: Iterable, gpu_kernels: Callable[[str], list]) -> Dict[str, int]:
    """Of the ops placed on a GPU, how many of each type have no GPU kernel for their attributes
    (soft placement runs those on the CPU). `ops`: graph operations; `gpu_kernels`: op type ->
    GPU KernelDefs (gpu_kernel_lookup, or a test's own)."""
    fallen: Dict[str, int] = {}
    for op in ops:
        if device_type_of(op.device) != GPU:
            continue
        if not any(_attrs_allowed(op, kernel) for kernel in gpu_kernels(op.type)):
            fallen[op.type] = fallen.get(op.type, 0) + 1
    return dict(sorted(fallen.items()))


def device_type_of(device: str) -> Optional[str]:
    """The device type a device string names ("/job:worker/task:1/device:GPU:0" -> "GPU")."""
    found = re.search(r"/device:([A-Za-z_]+)(?::|$)", device or "")
    return found.group(1).upper() if found else None


def _attrs_allowed(op, kernel) -> bool:
    for constraint in kernel.constraint:
        allowed = list(constraint.allowed_values.list.type)
        if not allowed:
            continue
        try:
            value = op.get_attr(constraint.name)
        except ValueError:
            return False
        if value not in allowed and getattr(value, "as_datatype_enum", None) not in allowed:
            return False
    return True
