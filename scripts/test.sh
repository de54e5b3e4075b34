#!/usr/bin/env bash
# Runs the test suite, after doing whatever set-up is still missing (scripts/setup.sh).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k block_manager`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
