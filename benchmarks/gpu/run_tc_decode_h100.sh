#!/usr/bin/env bash
# flashinfer's tensor-core decode kernel against its CUDA-core one on the H100, in one device call, after
# `bash benchmarks/gpu/run_serve_h100.sh stage` once per carried folder (ray, flashinfer, .carry/azure,
# .carry/fi-jit):
#   1. benchmarks.gpu.mixed_attention: 32 layers' attention of mixed and pure-decode steps, both kernels
#   2. the backend's and the decode graphs' GPU tests with BULLET_RAY_DECODE_TENSOR_CORES=1
#   3. benchmarks.offline, 300 Azure-conversation requests, chunked schedule, 2,048-token budget, once with
#      each kernel (same machine, back to back)
# Results (JSON, logs, step logs) in $OUT.
set -u
OUT=${OUT:-/tmp/out}; export OUT
LIMIT=150 bash benchmarks/gpu/run_serve_h100.sh py benchmarks.gpu.mixed_attention \
  --out "$OUT/mixed_attention_tc_h100.json" | grep "^{"
BULLET_RAY_DECODE_TENSOR_CORES=1 LIMIT=200 bash benchmarks/gpu/run_serve_h100.sh py pytest -q -p no:cacheprovider -m gpu \
  tests/gpu/test_engine_gpu.py tests/gpu/test_async_gpu.py 2>&1 | grep -E "passed|failed|Error" | tail -5
for tc in 0 1; do
  BULLET_RAY_DECODE_TENSOR_CORES=$tc LIMIT=150 bash benchmarks/gpu/run_serve_h100.sh py benchmarks.offline \
    --num-prompts 300 --max-num-batched-tokens 2048 --trace-path /tmp/azure \
    --step-log "$OUT/offline-tc$tc-steps.jsonl" --out "$OUT/offline_tc${tc}_h100.json" > /dev/null 2>&1
  gzip -f "$OUT/offline-tc$tc-steps.jsonl"; mv "$OUT/log_offline.txt" "$OUT/log_offline_tc$tc.txt"
  python3 -c "import json; d = json.load(open('$OUT/offline_tc${tc}_h100.json'))['ours']; \
print('tensor cores $tc:', d['requests_per_s'], 'req/s', d['output_tokens_per_s'], 'out tok/s')"
done
rm -f "$OUT/fi_jit_cache.tgz"
