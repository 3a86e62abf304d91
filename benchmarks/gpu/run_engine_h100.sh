#!/usr/bin/env bash
# One device call for the engine's GPU path: install the carried flashinfer wheels, build its JIT kernels
# in parallel, then the GPU tests, correctness, speed and the two-process engine, each under a deadline.
# Run from the repo root on the GPU machine; results land in $OUT.
#   bash benchmarks/gpu/run_engine_h100.sh stage   copy the .carry/ parts that came with this call to /tmp/wh
#                                                  (and unpack a carried JIT cache); once per part, back to back
#   bash benchmarks/gpu/run_engine_h100.sh         install what is staged or carried, then run STEPS
# STEPS (default "warm_jit tests correctness speed two_process") picks and orders the steps.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/wh /tmp/site
stage() {
  for d in .carry/flashinfer-*; do [ -d "$d" ] && cp -r "$d"/* /tmp/wh/; done
  if [ -f .carry/fi-jit/fi_jit_cache.tgz ]; then tar xzf .carry/fi-jit/fi_jit_cache.tgz -C /tmp; fi
}
stage
if [ "${1:-}" = stage ]; then ls /tmp/wh; exit 0; fi
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws FLASHINFER_USE_CUDA_NORM=1
if [ ! -f /tmp/site/.installed ]; then
  (cd /tmp/wh && for f in $(ls *.part.00 2>/dev/null); do cat "${f%.part.00}".part.* > "${f%.part.00}"; rm -f "${f%.part.00}".part.*; done)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/wh/*.whl || exit 3
  # pip stamps what it installs with today's time: date it all back (flashinfer's sources and the
  # tvm_ffi headers its objects depend on) so the carried JIT cache's objects are newer than their inputs
  find /tmp/site -type f -exec touch -d 2026-01-01 {} +
  touch /tmp/site/.installed
fi
export PYTHONPATH=/tmp/site:$PWD
LIMIT=${LIMIT:-570}
step() {  # step NAME CAP CMD...: run with timeout min(CAP, time left)
  local name=$1 cap=$2; shift 2
  local left=$((LIMIT - SECONDS)); [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 20 ]; then echo "== skip $name (no time left)"; return; fi
  echo "== $name (cap ${cap}s, t=${SECONDS}s)"
  timeout -k 5 "$cap" "$@" 2>&1 | tee -a "$OUT/engine_log.txt" | grep -v "^\s*$" | tail -40
  echo "== $name done rc=${PIPESTATUS[0]} t=${SECONDS}s"
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/engine_log.txt"
for name in ${STEPS:-warm_jit tests correctness speed two_process}; do
  case $name in
    warm_jit) step warm_jit 200 python3 -m benchmarks.gpu.warm_jit ;;
    tests) step tests 120 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_engine_gpu.py -m gpu ;;
    correctness) step correctness 150 python3 -m benchmarks.gpu.engine_correctness ;;
    speed) step speed 280 python3 -m benchmarks.gpu.engine_speed ;;
    two_process) step two_process 300 python3 -m benchmarks.gpu.engine_two_process ;;
    *) echo "unknown step $name" ;;
  esac
done
tar czf "$OUT/fi_jit_cache.tgz" -C /tmp fi_ws 2>/dev/null; ls -la "$OUT"
