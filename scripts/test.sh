#!/usr/bin/env bash
# Runs the test suite, after doing whatever set-up is still missing (scripts/setup.sh).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k block_manager`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# One pytest-xdist worker a core (PAGEDGEN_TEST_WORKERS overrides: 0 runs in this process), each
# taking whole files (module fixtures built once); tests/conftest.py gives each worker its share of
# the cores' threads.
exec .venv/bin/python -m pytest -n "${PAGEDGEN_TEST_WORKERS:-auto}" --dist loadfile "$@"
