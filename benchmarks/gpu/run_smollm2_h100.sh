#!/usr/bin/env bash
# bf16 GPU vs CPU float32 on real weights (the embedded SmolLM2, peaked logits), then the engine's GPU batch
# (run_engine_h100.sh). Stage first, one call per carried folder: `bash benchmarks/gpu/run_smollm2_h100.sh stage`
# with .carry/flashinfer-a + fi-jit, flashinfer-b, smol-a (GGUF part 0), smol-b (part 1 + the gguf wheel);
# smol-a/b come from benchmarks/gpu/carry_smollm2.sh. Inside a serving lease, run_serve_h100.sh stages the same parts
# (then `py benchmarks.gpu.engine_correctness --model /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --chunked-check`).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/wh /tmp/site
if [ "${1:-}" = stage ]; then
  for d in .carry/*/; do case "$d" in *fi-jit*|*azure*) ;; *) cp -r "$d"* /tmp/wh/;; esac; done
  [ -f .carry/fi-jit/fi_jit_cache.tgz ] && tar xzf .carry/fi-jit/fi_jit_cache.tgz -C /tmp
  ls /tmp/wh | wc -l; exit 0
fi
(cd /tmp/wh && cat smolpart[0-9]* > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf && rm -f smolpart[0-9]*)
(cd /tmp/wh && for f in $(ls *.part.00 2>/dev/null); do cat "${f%.part.00}".part.* > "${f%.part.00}"; rm -f "${f%.part.00}".part.*; done)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/wh/*.whl || exit 3
find /tmp/site -type f -exec touch -d 2026-01-01 {} +  # older than the carried JIT cache's objects: no rebuild
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws FLASHINFER_USE_CUDA_NORM=1 PYTHONPATH=/tmp/site:$PWD
make -s -C native >/dev/null
timeout 240 python3 -m benchmarks.gpu.warm_jit 2>&1 | tail -2
timeout 200 python3 -m benchmarks.gpu.engine_correctness --model /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \
  --name gpu_engine_correctness_smollm2_h100 --chunked-check 2>&1 | grep -v "^\s*$" | tail -4
LIMIT=$((560 - SECONDS)) bash benchmarks/gpu/run_engine_h100.sh
