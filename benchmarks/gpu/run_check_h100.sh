#!/usr/bin/env bash
# Two back-to-back device calls (the carried files exceed one call's 64 MiB): `stage` copies the carried
# folders to /tmp/wh (and unpacks a saved flashinfer JIT cache), `run` adds the rest, installs and runs
# the schedule check (and the GPU tests). Run from the repo root on the GPU machine.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/wh /tmp/site
for d in .carry/flashinfer-*; do [ -d "$d" ] && cp -r "$d"/* /tmp/wh/; done
[ -f .carry/fi-jit/fi_jit_cache.tgz ] && tar xzf .carry/fi-jit/fi_jit_cache.tgz -C /tmp
ls /tmp/wh; [ "${1:-run}" = stage ] && exit 0
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws FLASHINFER_USE_CUDA_NORM=1
(cd /tmp/wh && for f in $(ls *.part.00 2>/dev/null); do cat "${f%.part.00}".part.* > "${f%.part.00}"; rm -f "${f%.part.00}".part.*; done)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/wh/*.whl || exit 3
find /tmp/site -type f -exec touch -d 2026-01-01 {} +  # older than the carried JIT cache's objects: no rebuild
export PYTHONPATH=/tmp/site:$PWD
[ -d /tmp/fi_ws ] || timeout 200 python3 -m benchmarks.gpu.warm_jit
timeout 420 python3 -m benchmarks.gpu.engine_schedule_check ${VARIANTS:-} 2>&1 | tee "$OUT/check_log.txt" | grep -v "^\s*$" | tail -30
timeout 90 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_engine_gpu.py -m gpu 2>&1 | tail -5
