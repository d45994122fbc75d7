#!/usr/bin/env bash
# `make gpu-sglang`: the real-SGLang tests (tests/service/test_sglang_server.py, tests/e2e/test_sglang_rl.py) on NVIDIA GPUs,
# SGLang on CUDA and every weight push over NCCL, the production path that CPU CI runs with gloo.
# Needs a Linux machine with a GPU (two or more for nothing extra: the TP test is CPU-only) and PyPI access:
# it builds two environments under .cache/ (the project with CUDA torch, and SGLang as its own wheel pins it).
# Not run in CI: CI machines have no GPU. Last run: see the issue notes (none yet on this project's machines).
set -euo pipefail
cd "$(dirname "$0")/.."

command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 \
  || { echo "gpu-sglang: no NVIDIA GPU here (nvidia-smi -L failed)" >&2; exit 2; }
PYTHON=${PYTHON:-python3}
SGLANG_VERSION=$(sed -n 's/^SGLANG_VERSION = "\(.*\)"$/\1/p' services/areal_k8s/common/sglang.py)
TORCH_VERSION=$(sed -n 's/^  "torch==\(.*\)",$/\1/p' pyproject.toml)
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cu130}   # the CUDA of images/sglang and images/trainer

# the project (trainer side of the push) with CUDA torch
if [ ! -f .cache/gpu-venv/.installed ]; then
  "$PYTHON" -m venv .cache/gpu-venv
  .cache/gpu-venv/bin/pip install --quiet --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION"
  .cache/gpu-venv/bin/pip install --quiet -e '.[test]'
  touch .cache/gpu-venv/.installed
fi
# SGLang as its own metadata pins it (CUDA kernels included), where testing/areal_k8s_testing/sglang_server.py
# looks for it
if [ ! -f .cache/sglang-env/.built ] || ! grep -q cuda .cache/sglang-env/.built; then
  rm -rf .cache/sglang-env
  "$PYTHON" -m venv .cache/sglang-env
  .cache/sglang-env/bin/pip install --quiet --extra-index-url "$TORCH_INDEX" "sglang==$SGLANG_VERSION"
  echo "cuda sglang==$SGLANG_VERSION" > .cache/sglang-env/.built
fi
.cache/gpu-venv/bin/python proto/generate.py
AREAL_GPU=1 AREAL_REQUIRE_SGLANG=1 .cache/gpu-venv/bin/pytest tests/service/test_sglang_server.py tests/e2e/test_sglang_rl.py tests/service/test_sglang_contract.py "$@"
