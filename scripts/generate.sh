#!/usr/bin/env bash
# The main job: generation for 1,000 TinyStories openings with ../shared/models/stories260K,
# after doing whatever set-up is still missing. Extra arguments go to examples/offline_batch.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/offline_batch.py "$@"
