#!/usr/bin/env bash
# Set-up: makes .venv, installs the pinned dependencies (requirements.txt, then the integrations'
# requirements-extras.txt) and builds the extension pagedgen._C. Idempotent: each step runs only when
# what it depends on has changed.
# Facts behind the flags: ../shared/ENVIRONMENT.md (torch 2.14.1 CUDA 13.0 build, CUDA toolkit, -g0).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
VENV=${PAGEDGEN_VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

req_hash=$(sha256sum requirements.txt | cut -c1-16)
if [ "$(cat "$VENV/.pagedgen-req" 2>/dev/null)" != "$req_hash" ]; then
  echo "[setup] installing pinned dependencies (first time: a few minutes)"
  "$PY" -m pip install -q --upgrade pip setuptools wheel
  "$PY" -m pip install -q -r requirements.txt
  echo "$req_hash" > "$VENV/.pagedgen-req"
fi

# The integrations' dependencies (lm_eval, ray), constrained by requirements.txt so that they leave
# torch and friends alone; installed so that their tests run instead of skipping.
extras_hash=$(cat requirements.txt requirements-extras.txt | sha256sum | cut -c1-16)
if [ "$(cat "$VENV/.pagedgen-extras" 2>/dev/null)" != "$extras_hash" ]; then
  echo "[setup] installing the integrations' dependencies (requirements-extras.txt: lm_eval, ray)"
  "$PY" -m pip install -q -r requirements-extras.txt -c requirements.txt
  echo "$extras_hash" > "$VENV/.pagedgen-extras"
fi

# The CUDA toolkit for csrc/cuda/*.cu: setup.py finds it (find_cuda_home: CUDA_HOME if set, else the
# toolkit of the nvcc on the PATH, else /usr/local/cuda*); the last line below says whether it did.
export MAX_JOBS=${MAX_JOBS:-2}

# The CPU kernels are built with -march=native: a checkout moved to another CPU kind (the same
# machine name can come back as a Xeon with AMX or an EPYC with AVX2 only) rebuilds them.
cpu_flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m)
src_hash=$( (find setup.py pyproject.toml csrc -type f | LC_ALL=C sort | xargs cat; echo "$cpu_flags"; echo "${CUDA_HOME:-}") | sha256sum | cut -c1-16)
if [ "$(cat "$VENV/.pagedgen-ext" 2>/dev/null)" != "$src_hash" ] || ! ls pagedgen/_C*.so >/dev/null 2>&1; then
  echo "[setup] building the extension pagedgen._C (a few minutes)"
  cpu_hash=$(echo "$cpu_flags" | sha256sum | cut -c1-16)
  if [ "$(cat "$VENV/.pagedgen-cpu" 2>/dev/null)" != "$cpu_hash" ]; then
    # Another CPU kind: ninja would find the objects of build/ up to date (the -march=native
    # command line is the same everywhere) and relink code this CPU may not run.
    rm -rf build pagedgen/_C*.so
  fi
  "$PY" -m pip install -q --no-build-isolation --no-deps -e .
  echo "$src_hash" > "$VENV/.pagedgen-ext"
  echo "$cpu_hash" > "$VENV/.pagedgen-cpu"
fi
"$PY" -c "import pagedgen.ops as o; assert o.extension_available('cpu'), o.extension_error('cpu'); print('[setup] ok: pagedgen._C loaded, CUDA kernels', 'built' if o.extension_available('cuda') else 'not built (PAGEDGEN_NO_CUDA=1, a CPU-only torch or no CUDA toolkit found: see setup.py)')"
