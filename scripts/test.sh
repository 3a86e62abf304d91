#!/usr/bin/env bash
# The test command: install (idempotent), lint, type-check, and run every test that needs no GPU (the 15 slowest
# named at the end, to keep the suite fast on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
ruff check bullet_ray tests benchmarks
mypy bullet_ray
python -m pytest -m "not gpu" -q -p no:cacheprovider --durations=15 "$@"
