#!/usr/bin/env bash
# Creates .venv at the repo root and builds the engines into it. Idempotent: each step is
# skipped when its result is already there, so a second run does no rebuild.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/.venv"
py="$venv/bin/python"
stamp_dir="$venv/.parallax_setup"
HOROVOD_VERSION=0.28.1
TF_VERSION=2.21.*
TF_KERAS_VERSION=2.21.0

log() { printf '[setup] %s\n' "$*"; }

# Which TensorFlow, and which Horovod operations. PARALLAX_DEVICE=gpu|cpu forces the choice;
# unset, a machine where nvidia-smi lists a GPU gets TensorFlow with CUDA. `--plan` prints the
# choice and changes nothing.
device="${PARALLAX_DEVICE:-auto}"
if [ "$device" = auto ]; then
  device=cpu
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then device=gpu; fi
fi
case "$device" in
  gpu) tf_package="tensorflow[and-cuda]==$TF_VERSION"; other_tf=tensorflow-cpu ;;
  cpu) tf_package="tensorflow-cpu==$TF_VERSION"; other_tf=tensorflow ;;
  *) echo "[setup] PARALLAX_DEVICE=$device: set it to gpu or cpu, or leave it unset to choose by nvidia-smi" >&2; exit 2 ;;
esac

# Horovod's GPU operations need nvcc and NCCL of TensorFlow's own CUDA: the nvidia-* wheels that
# tensorflow[and-cuda] installs carry both, gathered into one toolkit folder for Horovod's CMake.
# PARALLAX_CUDA_HOME names another toolkit (same CUDA major version as TensorFlow's).
wheels_cuda() {   # prints the toolkit folder it assembled, or nothing
  local site nv out
  site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null) || return 0
  nv="$site/nvidia"
  [ -x "$nv/cuda_nvcc/bin/nvcc" ] && [ -f "$nv/cuda_runtime/include/cuda_runtime.h" ] && [ -f "$nv/nccl/include/nccl.h" ] || return 0
  out="$stamp_dir/cuda"
  rm -rf "$out"; mkdir -p "$out/lib64"
  cp -rs "$nv/cuda_nvcc/." "$out/"                 # bin/nvcc, nvvm/, include/ (crt)
  cp -rs "$nv/cuda_runtime/include/." "$out/include/"
  cp -rs "$nv/nccl/include/." "$out/include/"
  for lib in "$nv"/cuda_runtime/lib/*.so* "$nv"/nccl/lib/*.so*; do
    ln -sf "$lib" "$out/lib64/$(basename "$lib")"
    ln -sf "$lib" "$out/lib64/$(basename "$lib" | sed 's/\.so\..*/.so/')"    # the unversioned name CMake links
  done
  echo "$out"
}

if [ "${1:-}" = "--plan" ]; then
  echo "device: $device (PARALLAX_DEVICE=${PARALLAX_DEVICE:-unset})"
  echo "tensorflow: $tf_package"
  if [ "$device" = gpu ]; then
    echo "horovod operations: NCCL where the CUDA toolkit is found (${PARALLAX_CUDA_HOME:-the nvidia-* wheels of tensorflow[and-cuda]}), else CPU (GPU tensors through host memory)"
    [ -n "${PARALLAX_CUDA_HOME:-}" ] && echo "cuda toolkit: $PARALLAX_CUDA_HOME ($([ -x "$PARALLAX_CUDA_HOME/bin/nvcc" ] && echo 'has nvcc' || echo 'no bin/nvcc'))"
  else
    echo "horovod operations: CPU (gloo, MPI where OpenMPI is installed)"
  fi
  exit 0
fi

# 1. System packages: OpenMPI so Horovod builds with both gloo and MPI (mpirun tests); an ssh
#    server for the tests that start ranks over ssh on emulated hosts (tools/ssh_hosts.py).
if ! command -v mpicxx >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1 || [ ! -x /usr/sbin/sshd ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing OpenMPI, cmake, iproute2, openssh from Debian"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenmpi-dev openmpi-bin cmake g++ iproute2 \
      openssh-client openssh-server >/dev/null
  else
    log "OpenMPI or sshd is missing and this is not a root Debian host: install libopenmpi-dev, openmpi-bin and"
    log "openssh-server, or Horovod is built without MPI and the ssh tests fail"
  fi
fi

# 2. The virtual environment and the Python packages.
if [ ! -x "$py" ]; then
  log "creating $venv"
  python3 -m venv "$venv"
fi
mkdir -p "$stamp_dir"
installed_for=$(cat "$stamp_dir/pip.done" 2>/dev/null || true)
if [ -f "$stamp_dir/pip.done" ] && [ "${installed_for:-cpu}" != "$device" ]; then     # (an empty stamp: a CPU venv)
  log "switching this venv to the $device TensorFlow: removing $other_tf and Horovod (rebuilt below)"
  "$py" -m pip uninstall -q -y "$other_tf" horovod >/dev/null 2>&1 || true
  rm -f "$stamp_dir/pip.done"
fi
if [ ! -f "$stamp_dir/pip.done" ]; then
  log "installing $tf_package, absl-py, numpy, pytest"
  "$py" -m pip install -q --upgrade pip wheel setuptools
  "$py" -m pip install -q "$tf_package" absl-py numpy pytest matplotlib cloudpickle psutil pyyaml packaging cffi
  echo "$device" > "$stamp_dir/pip.done"
fi
if ! "$py" -c "import matplotlib" >/dev/null 2>&1; then   # tools.bench plots (added later)
  "$py" -m pip install -q matplotlib
fi
# TensorBoard reads what --logdir writes; TensorFlow 2.21 no longer brings it
if ! "$py" -c "import tensorboard" >/dev/null 2>&1; then
  log "installing tensorboard"
  "$py" -m pip install -q tensorboard
fi
# tf_keras (Keras 2) for graph-mode Keras models: its wheel requires `tensorflow`, which would pull
# a second TF next to tensorflow-cpu, so it goes in without dependencies, pinned to the TF version.
if ! "$py" -c "import tf_keras" >/dev/null 2>&1; then
  log "installing tf_keras $TF_KERAS_VERSION (no dependencies)"
  "$py" -m pip install -q --no-deps "tf_keras==$TF_KERAS_VERSION"
fi

# 3. Horovod from its sdist, patched for TF 2.21 (see BUILD.md).
if ! "$py" -c "import horovod.tensorflow" >/dev/null 2>&1; then
  build="$stamp_dir/horovod-build"
  rm -rf "$build"; mkdir -p "$build"
  log "downloading horovod $HOROVOD_VERSION sdist"
  "$py" -m pip download -q --no-deps --no-binary :all: -d "$build" "horovod==$HOROVOD_VERSION"
  tar -xzf "$build"/horovod-$HOROVOD_VERSION.tar.gz -C "$build"
  src="$build/horovod-$HOROVOD_VERSION"
  # xla_mpi_ops.cc includes XLA headers the TF 2.21 wheel no longer ships; its code serves
  # Horovod ops inside XLA-compiled GPU clusters only, which parallax_tf's graphs never form.
  sed -i '/xla_mpi_ops\.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
  if grep -q xla_mpi_ops "$src/horovod/tensorflow/CMakeLists.txt"; then
    echo "[setup] could not remove xla_mpi_ops.cc from Horovod's CMakeLists.txt" >&2; exit 1
  fi
  mpi_flag=HOROVOD_WITHOUT_MPI
  command -v mpicxx >/dev/null 2>&1 && mpi_flag=HOROVOD_WITH_MPI
  gpu_env=()
  operations=CPU
  if [ "$device" = gpu ]; then
    cuda_home="${PARALLAX_CUDA_HOME:-$(wheels_cuda)}"
    if [ -n "$cuda_home" ] && [ -x "$cuda_home/bin/nvcc" ]; then
      gpu_env=(HOROVOD_GPU_OPERATIONS=NCCL "HOROVOD_CUDA_HOME=$cuda_home" HOROVOD_NCCL_LINK=SHARED
               "HOROVOD_NCCL_INCLUDE=$cuda_home/include" "HOROVOD_NCCL_LIB=$cuda_home/lib64" "PATH=$cuda_home/bin:$PATH")
      operations="NCCL, CUDA at $cuda_home"
    else
      log "no CUDA toolkit with nvcc and NCCL found: Horovod gets CPU operations (GPU tensors go through host memory)"
    fi
  fi
  log "building horovod ($mpi_flag, gloo, $operations) - takes a few minutes"
  env HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 "$mpi_flag=1" HOROVOD_WITHOUT_PYTORCH=1 \
      HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=GLOO MAKEFLAGS="-j$(nproc)" "${gpu_env[@]}" \
      "$py" -m pip install -q --no-build-isolation --no-cache-dir "$src"
  rm -rf "$build"
fi

# 4. The project itself (editable) and its compiled custom ops.
# (find fails while project.done does not exist yet: `|| true` keeps set -e/pipefail from exiting)
ops_newer=$(find "$root/parallax_tf/ops" \( -name '*.cc' -o -name '*.h' \) -newer "$stamp_dir/project.done" 2>/dev/null | head -1 || true)
if [ ! -f "$stamp_dir/project.done" ] || [ "$root/setup.py" -nt "$stamp_dir/project.done" ] || [ -n "$ops_newer" ] \
   || ! ls "$root"/parallax_tf/_bindshim*.so >/dev/null 2>&1 || ! ls "$root"/parallax_tf/_parallax_ops*.so >/dev/null 2>&1; then
  if [ -f "$root/setup.py" ]; then
    log "installing parallax_tf (editable) and building its compiled ops"
    "$py" -m pip install -q --no-build-isolation --no-deps -e "$root"
    touch "$stamp_dir/project.done"
  fi
fi
log "ready: $("$py" -c 'import tensorflow as tf, horovod; print("tensorflow", tf.__version__, "horovod", horovod.__version__)' 2>/dev/null)"
