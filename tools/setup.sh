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

# 1. System packages: OpenMPI so Horovod builds with both gloo and MPI (mpirun tests).
if ! command -v mpicxx >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing OpenMPI, cmake, iproute2 from Debian"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenmpi-dev openmpi-bin cmake g++ iproute2 >/dev/null
  else
    log "OpenMPI is missing and this is not a root Debian host: install libopenmpi-dev and openmpi-bin, or Horovod is built without MPI"
  fi
fi

# 2. The virtual environment and the Python packages.
if [ ! -x "$py" ]; then
  log "creating $venv"
  python3 -m venv "$venv"
fi
mkdir -p "$stamp_dir"
if [ ! -f "$stamp_dir/pip.done" ]; then
  log "installing tensorflow-cpu $TF_VERSION, absl-py, numpy, pytest"
  "$py" -m pip install -q --upgrade pip wheel setuptools
  "$py" -m pip install -q "tensorflow-cpu==$TF_VERSION" absl-py numpy pytest matplotlib cloudpickle psutil pyyaml packaging cffi
  touch "$stamp_dir/pip.done"
fi
if ! "$py" -c "import matplotlib" >/dev/null 2>&1; then   # tools.bench plots (added later)
  "$py" -m pip install -q matplotlib
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
  # xla_mpi_ops.cc includes XLA headers the TF 2.21 wheel no longer ships; on CPU builds all of
  # its code sits under HAVE_GPU, so leaving it out of the build loses nothing.
  sed -i '/xla_mpi_ops\.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
  if grep -q xla_mpi_ops "$src/horovod/tensorflow/CMakeLists.txt"; then
    echo "[setup] could not remove xla_mpi_ops.cc from Horovod's CMakeLists.txt" >&2; exit 1
  fi
  mpi_flag=HOROVOD_WITHOUT_MPI
  command -v mpicxx >/dev/null 2>&1 && mpi_flag=HOROVOD_WITH_MPI
  log "building horovod ($mpi_flag, gloo, CPU) - takes a few minutes"
  env HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 "$mpi_flag=1" HOROVOD_WITHOUT_PYTORCH=1 \
      HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=GLOO MAKEFLAGS="-j$(nproc)" \
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
