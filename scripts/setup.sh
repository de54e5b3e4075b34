#!/usr/bin/env bash
# Set-up: makes .venv, installs the pinned dependencies (requirements.txt, then the integrations'
# requirements-extras.txt), builds the extension (pagedgen._C and the CPU kernels of each instruction-set
# level, setup.py) in place and installs pagedgen in .venv (editable). Idempotent: each step runs only
# when what it depends on has changed. It prints a line per step; what pip and the compiler print goes
# to .venv/setup.log, whose last lines it shows when a step fails.
# Facts behind the flags: ../shared/ENVIRONMENT.md (torch 2.14.1 CUDA 13.0 build, CUDA toolkit, -g0).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
VENV=${PAGEDGEN_VENV:-.venv}
started=$SECONDS

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
LOG="$VENV/setup.log"

# step WHAT COMMAND...: one line, the command's output appended to the log; on failure the log's last
# lines, its path, and exit 1.
step() {
  local what=$1
  shift
  echo "[setup] $what"
  echo "=== $(date -u +%FT%TZ) $what: $*" >>"$LOG"
  if ! "$@" >>"$LOG" 2>&1; then
    echo "[setup] FAILED: $what. The last lines of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    echo "[setup] FAILED: $what (the whole output is in $LOG)" >&2
    exit 1
  fi
}

req_hash=$(sha256sum requirements.txt | cut -c1-16)
if [ "$(cat "$VENV/.pagedgen-req" 2>/dev/null)" != "$req_hash" ]; then
  step "upgrading pip, setuptools and wheel" "$PY" -m pip install --upgrade pip setuptools wheel
  step "installing the pinned dependencies of requirements.txt (first time: several minutes)" \
    "$PY" -m pip install -r requirements.txt
  echo "$req_hash" > "$VENV/.pagedgen-req"
fi

# The integrations' dependencies (lm_eval, ray), constrained by requirements.txt so that they leave
# torch and friends alone; installed so that their tests run instead of skipping.
extras_hash=$(cat requirements.txt requirements-extras.txt | sha256sum | cut -c1-16)
if [ "$(cat "$VENV/.pagedgen-extras" 2>/dev/null)" != "$extras_hash" ]; then
  step "installing the integrations' dependencies (requirements-extras.txt: lm_eval, ray, sentence-transformers)" \
    "$PY" -m pip install -r requirements-extras.txt -c requirements.txt
  echo "$extras_hash" > "$VENV/.pagedgen-extras"
fi

# The CUDA toolkit for csrc/cuda/*.cu: setup.py finds it (find_cuda_home: CUDA_HOME if set, else the
# toolkit of the nvcc on the PATH, else /usr/local/cuda*); the last line below says whether it did.
export MAX_JOBS=${MAX_JOBS:-2}

# The CPU kernels are compiled once per level (setup.py's CPU_LEVELS, flags that name no machine), so
# the objects in build/ are good on every CPU kind and ninja rebuilds only what changed. A level built
# with -march=native (PAGEDGEN_CPU_LEVELS=native) is this machine's only: it is rebuilt when the CPU changes.
levels=${PAGEDGEN_CPU_LEVELS:-}
native=""
case ",$levels," in *,native,*) native=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m) ;; esac
src_hash=$( (find setup.py pyproject.toml csrc -type f | LC_ALL=C sort | xargs cat
             echo "$levels|$native|${CUDA_HOME:-}|${PAGEDGEN_NO_CUDA:-}") | sha256sum | cut -c1-16)
if [ "$(cat "$VENV/.pagedgen-ext" 2>/dev/null)" != "$src_hash" ] || ! ls pagedgen/_C.*so >/dev/null 2>&1; then
  if [ -n "$native" ] && [ "$(cat "$VENV/.pagedgen-native" 2>/dev/null)" != "$(echo "$native" | sha256sum)" ]; then
    rm -rf build/temp.*/_C_cpu_native pagedgen/_C_cpu_native.*so   # same command line, another CPU
  fi
  if ls -d build/temp.* >/dev/null 2>&1; then
    what="what changed since the last build"
  else
    what="from scratch: 3-5 minutes on a quiet 2-core machine, two or three times that on a busy one"
  fi
  step "building the extension: pagedgen._C and the CPU kernels of each instruction-set level ($what)" \
    "$PY" setup.py build_ext --inplace
  echo "$src_hash" > "$VENV/.pagedgen-ext"
  [ -z "$native" ] || echo "$native" | sha256sum > "$VENV/.pagedgen-native"
fi

# pagedgen itself, editable (the .venv/bin/pagedgen command, `import pagedgen` from anywhere); the
# extension built above is used where it lies, so this install compiles nothing (PAGEDGEN_SKIP_EXT).
meta_hash=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat "$VENV/.pagedgen-meta" 2>/dev/null)" != "$meta_hash" ]; then
  step "installing pagedgen into $VENV (editable)" \
    env PAGEDGEN_SKIP_EXT=1 "$PY" -m pip install --no-build-isolation --no-deps -e .
  echo "$meta_hash" > "$VENV/.pagedgen-meta"
fi
"$PY" - "$((SECONDS - started))" <<'EOF'
import sys

import pagedgen.ops as o

if not o.extension_available("cpu"):
    sys.exit(f"[setup] FAILED: the extension is built but its CPU kernels are not usable here: {o.extension_error('cpu')}")
cuda = "built" if o.extension_available("cuda") else "not built (PAGEDGEN_NO_CUDA=1, a CPU-only torch or no CUDA toolkit: see setup.py)"
print(f"[setup] ok in {sys.argv[1]} s: pagedgen._C loaded, CPU kernels of level {o.cpu_isa()}, CUDA kernels {cuda}")
EOF
