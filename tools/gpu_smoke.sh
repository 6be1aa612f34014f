#!/usr/bin/env bash
# The one command a GPU machine runs: a GPU build of the venv, the toolkit's self-check, the test
# suite, the demo, and plain TF against parallax_tf on the GPU (tools.gpu_compare). Stops at the
# first stage that fails. Everything it prints also goes to gpu_smoke.log at the repo root.
#
#     bash tools/gpu_smoke.sh        (from any directory)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# exported, not set for setup.sh alone: `make` reruns setup.sh when its inputs are newer than its
# stamp, and that run must build for the GPU too
export PARALLAX_DEVICE=gpu

stage=""
begin() { stage="$1"; printf '\n== %s == %s\n' "$stage" "$(date)"; }
report() {
  local status=$?
  if [ "$status" -ne 0 ]; then
    printf '\ngpu_smoke: FAILED in stage "%s" (exit status %s) %s\n' "$stage" "$status" "$(date)"
  else
    printf '\ngpu_smoke: all stages passed %s\n' "$(date)"
  fi
}

smoke() {
  trap report EXIT
  begin "GPU"
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_smoke: nvidia-smi not found: this machine has no NVIDIA driver, so no GPU to test on" >&2
    exit 1
  fi
  local gpus
  gpus="$(nvidia-smi -L 2>&1)" || true
  printf '%s\n' "$gpus"
  if ! grep -q '^GPU ' <<<"$gpus"; then
    echo "gpu_smoke: nvidia-smi -L lists no GPU (its output is above): nothing to test on" >&2
    exit 1
  fi

  begin "setup (PARALLAX_DEVICE=gpu bash tools/setup.sh)"
  bash tools/setup.sh

  begin "check (python -m parallax_tf check)"
  .venv/bin/python -m parallax_tf check

  begin "make test"
  make test

  begin "make demo"
  make demo

  begin "gpu_compare (lm, cnn; 200 steps)"
  .venv/bin/python -m tools.gpu_compare --models=lm,cnn --steps=200 --json=gpu_compare.json
}

# the subshell's trap reports the failing stage; pipefail passes its status through tee
( smoke ) 2>&1 | tee "$root/gpu_smoke.log"
