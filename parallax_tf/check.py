"""`python -m parallax_tf check`: what was built and whether it works on this machine.

Prints the versions, what Horovod was built with, whether the compiled ops and the bind shim
load, the CPUs and GPUs TensorFlow sees and the machine's interfaces; then runs two real ranks
on loopback (an allreduce and a round trip to a variable on the other rank's server). Ends with
`ok`, or with one line per problem naming the fix; the exit status is 0 or 1."""
from __future__ import annotations

import glob
import os
import sys
import time
from typing import List

PACKAGE = os.path.dirname(os.path.abspath(__file__))
SETUP_FIX = "run `make setup` (or `bash tools/setup.sh`) in the project; BUILD.md explains the build"


def main(argv: List[str]) -> int:
    ops_dir = PACKAGE
    ranks = True
    for arg in argv:
        if arg.startswith("--ops_dir="):
            ops_dir = arg.split("=", 1)[1]
        elif arg == "--no_ranks":
            ranks = False
        else:
            print(f"parallax_tf check: unknown argument {arg!r}; takes --ops_dir=DIR and --no_ranks", file=sys.stderr)
            return 2
    problems: List[str] = []
    _versions(problems)
    _horovod(problems)
    _compiled(ops_dir, problems)
    _devices(problems)
    _interfaces()
    if ranks and not problems:
        _two_ranks(problems)
    if problems:
        for problem in problems:
            print(f"broken: {problem}")
        return 1
    print("ok")
    return 0


def _line(what: str, value) -> None:
    print(f"{what:<22} {value}", flush=True)


def _versions(problems) -> None:
    import tensorflow as tf
    _line("python", sys.version.split()[0])
    _line("tensorflow", tf.__version__)
    try:
        import tf_keras
        _line("tf_keras", tf_keras.__version__)
    except ImportError:
        _line("tf_keras", "not installed (needed only for tf_keras models)")
    try:
        import horovod
        _line("horovod", horovod.__version__)
    except ImportError:
        problems.append(f"horovod is not installed: {SETUP_FIX}")


def _horovod(problems) -> None:
    try:
        import horovod.tensorflow as hvd
    except Exception as err:      # an ImportError, or the binding's own load error
        problems.append(f"Horovod's TensorFlow binding cannot be imported ({str(err).splitlines()[0][:160]}): {SETUP_FIX}")
        return
    built = {name: getattr(hvd, f"{name}_built")() for name in ("gloo", "mpi", "nccl", "cuda")}
    _line("horovod controllers", ", ".join(n for n in ("gloo", "mpi") if built[n]) or "none")
    _line("horovod operations", "NCCL on GPU tensors" if built["nccl"] else "CPU (gloo/MPI): GPU tensors go "
          "through host memory" if built["cuda"] else "CPU (gloo/MPI)")
    if not built["gloo"] and not built["mpi"]:
        problems.append(f"Horovod was built without gloo and MPI: no rank can start. {SETUP_FIX}")


def _compiled(ops_dir: str, problems) -> None:
    import tensorflow as tf
    ops = sorted(glob.glob(os.path.join(ops_dir, "_parallax_ops*.so")))
    if not ops:
        problems.append(f"the compiled ops are not built (no _parallax_ops*.so in {ops_dir}): {SETUP_FIX}")
    else:
        try:
            names = [n for n in dir(tf.load_op_library(ops[0])) if n.startswith("parallax_")]
            _line("compiled ops", f"{len(names)} loaded from {ops[0]}")
        except Exception as err:
            problems.append(f"the compiled ops in {ops[0]} do not load ({str(err).splitlines()[0][:160]}); they "
                            f"were built against another TensorFlow: {SETUP_FIX}")
    shims = sorted(glob.glob(os.path.join(ops_dir, "_bindshim*.so")))
    if not shims:
        problems.append(f"the bind shim is not built (no _bindshim*.so in {ops_dir}): {SETUP_FIX}, or run with "
                        "--bind_address=0.0.0.0 to let the servers listen on every interface")
        return
    try:
        import ctypes
        ctypes.CDLL(shims[0])
        _line("bind shim", f"loads ({shims[0]})")
    except OSError as err:
        problems.append(f"the bind shim {shims[0]} does not load ({err}): {SETUP_FIX}")


def _devices(problems) -> None:
    import tensorflow as tf
    from parallax_tf import threads
    _line("cpus", f"{os.cpu_count()} on the machine, {threads.available_cores():g} this process may use")
    cuda = tf.sysconfig.get_build_info().get("cuda_version")
    _line("tensorflow build", f"CUDA {cuda}" if tf.test.is_built_with_cuda() else "CPU only")
    gpus = tf.config.list_physical_devices("GPU")
    _line("gpus (tensorflow)", ", ".join(g.name for g in gpus) or "none")
    _line("ranks compute on", f"one GPU each, up to {len(gpus)} rank(s) per host (README: ranks and GPUs)"
          if gpus else "the CPU")
    smi = _nvidia_smi_gpus()
    if smi and not gpus:
        problems.append(f"nvidia-smi lists {smi} GPU(s) but TensorFlow lists none: "
                        + ("this TensorFlow has no CUDA; set it up with `PARALLAX_DEVICE=gpu make setup` (BUILD.md, 'GPUs')"
                           if not tf.test.is_built_with_cuda() else
                           "check CUDA_VISIBLE_DEVICES and the CUDA libraries (TensorFlow's log with --verbose says which is missing)"))


def _nvidia_smi_gpus() -> int:
    import shutil
    import subprocess
    if not shutil.which("nvidia-smi"):
        return 0
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in listed.splitlines())


def _interfaces() -> None:
    try:
        import psutil
        found = [f"{name} {a.address}" for name, addresses in sorted(psutil.net_if_addrs().items())
                 for a in addresses if a.family.name in ("AF_INET", "AF_INET6")]
    except ImportError:
        found = [name for _, name in __import__("socket").if_nameindex()]
    _line("interfaces", "; ".join(found) or "none")


def _two_ranks(problems) -> None:
    from parallax_tf.runtime import bind, launcher
    began = time.perf_counter()
    command = [sys.executable, "-m", "parallax_tf.check_ranks"]
    env = bind.preload_env(dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
                                PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(PACKAGE),
                                                                          os.environ.get("PYTHONPATH")]))))
    try:
        status = launcher.run(command, "localhost:2", 2, env, {"lo"}, "127.0.0.1", timeout_s=120)
    except SystemExit as stop:
        status = stop.code or 1
    if status != 0:
        problems.append(f"two ranks on loopback failed (status {status}; the lines above say where). Run it "
                        "again with --verbose on a training script for TensorFlow's and Horovod's own logs")
        return
    _line("two ranks", f"allreduce and a PS round trip on loopback in {time.perf_counter() - began:.1f}s")
