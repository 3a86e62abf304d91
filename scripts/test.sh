#!/usr/bin/env bash
# The test command: install (idempotent), lint, type-check, and run every test that needs no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
ruff check bullet_ray tests benchmarks
mypy bullet_ray
python -m pytest -m "not gpu" -q -p no:cacheprovider "$@"
