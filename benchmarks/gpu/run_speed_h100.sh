#!/usr/bin/env bash
# One device call for the engine-speed issue: install the carried wheels (flashinfer; vLLM into its own
# folder), warm the JIT kernels, then each step under a deadline. Run from the repo root on the GPU machine;
# results land in $OUT.
#   bash benchmarks/gpu/run_speed_h100.sh stage    copy the .carry/ parts that came with this call (flashinfer,
#                                                  vllm wheels, a JIT cache, the Azure traces); once per part
#   bash benchmarks/gpu/run_speed_h100.sh          install what is staged, then run STEPS
# STEPS (default "warm_jit tests speed offline hops") picks and orders the steps:
#   tests    tests/gpu (async scheduling, start-up graphs, graph vs eager, flashinfer vs torch)
#   speed    benchmarks.gpu.engine_speed (prefill MFU, decode bandwidth, kernels per step, chunked graphs vs eager)
#   offline  benchmarks.offline --vllm: 1,000 Azure-conversation requests, ours then vLLM's LLM.generate
#   hops     benchmarks.hops on the GPU: TTFT / inter-token latency per hop (in-process, Serve handle, HTTP)
# NUM_PROMPTS (default 1000) sizes the offline run; OFFLINE_ARGS adds flags (e.g. "--schedule bullet").
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/wh /tmp/whv /tmp/site /tmp/vsite /tmp/azure
stage() {
  for d in .carry/flashinfer-* .carry/ray-*; do [ -d "$d" ] && cp -r "$d"/* /tmp/wh/; done
  for d in .carry/vllm-*; do [ -d "$d" ] && cp -r "$d"/* /tmp/whv/; done
  if [ -f .carry/fi-jit/fi_jit_cache.tgz ]; then tar xzf .carry/fi-jit/fi_jit_cache.tgz -C /tmp; fi
  if [ -d .carry/azure ]; then cp .carry/azure/* /tmp/azure/; fi
}
stage
if [ "${1:-}" = stage ]; then echo "wheels: $(ls /tmp/wh | wc -l) ours, $(ls /tmp/whv | wc -l) vllm"; ls /tmp/azure; exit 0; fi
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws FLASHINFER_USE_CUDA_NORM=1 VLLM_SITE=/tmp/vsite
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH RAY_USAGE_STATS_ENABLED=0
join_parts() { (cd "$1" && for f in $(ls *.part.00 2>/dev/null); do cat "${f%.part.00}".part.* > "${f%.part.00}"; rm -f "${f%.part.00}".part.*; done); }
if [ ! -f /tmp/site/.installed ]; then
  join_parts /tmp/wh
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/wh/*.whl || exit 3
  # pip stamps what it installs with today's time: date it back so the carried JIT cache stays newer
  find /tmp/site -type f -exec touch -d 2026-01-01 {} +
  touch /tmp/site/.installed
fi
if [ ! -f /tmp/vsite/.installed ] && [ -n "$(ls /tmp/whv 2>/dev/null)" ]; then
  join_parts /tmp/whv
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite /tmp/whv/*.whl || exit 5
  touch /tmp/vsite/.installed
fi
make -s -C native >/dev/null 2>&1 || echo "native/ did not build (bullet schedule needs it; chunked does not)"
TRACE=/tmp/azure; [ -n "$(ls /tmp/azure 2>/dev/null)" ] || TRACE=../shared/data/azure-llm-inference-2023
LIMIT=${LIMIT:-570}
step() {  # step NAME CAP CMD...: run with timeout min(CAP, time left)
  local name=$1 cap=$2; shift 2
  local left=$((LIMIT - SECONDS)); [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 20 ]; then echo "== skip $name (no time left)"; return; fi
  echo "== $name (cap ${cap}s, t=${SECONDS}s)"
  timeout -k 5 "$cap" "$@" 2>&1 | tee -a "$OUT/speed_log.txt" | grep -v "^\s*$" | grep -v "it/s\]$" | tail -40
  echo "== $name done rc=${PIPESTATUS[0]} t=${SECONDS}s"
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/speed_log.txt"
for name in ${STEPS:-warm_jit tests speed offline hops}; do
  case $name in
    warm_jit) [ -f /tmp/.jit_warm ] || { step warm_jit 240 python3 -m benchmarks.gpu.warm_jit && touch /tmp/.jit_warm; } ;;
    tests) step tests 150 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_async_gpu.py tests/gpu/test_engine_gpu.py -m gpu ;;
    speed) step speed 300 python3 -m benchmarks.gpu.engine_speed ;;
    offline) step offline 540 python3 -m benchmarks.offline --vllm --num-prompts "${NUM_PROMPTS:-1000}" \
               --trace-path "$TRACE" --out "$OUT/offline_h100.json" ${OFFLINE_ARGS:-} ;;
    hops) step hops 240 python3 -m benchmarks.hops --device cuda --model dummy:llama-3.1-8b --out "$OUT/hops_h100.json" ;;
    *) echo "unknown step $name" ;;
  esac
done
tar czf "$OUT/fi_jit_cache.tgz" -C /tmp fi_ws 2>/dev/null; ls -la "$OUT"
