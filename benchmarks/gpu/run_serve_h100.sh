#!/usr/bin/env bash
# Device calls for the Serve application on the H100 (run from the repo root on the GPU machine).
#   stage            copy whatever .carry/ folders came with this call: ray and flashinfer wheels to /tmp/wh,
#                    vLLM's to /tmp/whv, a flashinfer JIT cache (.carry/fi-jit), the Azure traces (.carry/azure),
#                    cuBLASLt choices (.carry/lt-cache/lt_gemm.json), the embedded SmolLM2's GGUF in parts and the
#                    gguf wheel (.carry/smol-a, smol-b from benchmarks/gpu/carry_smollm2.sh; joined at install as
#                    /tmp/SmolLM2-135M-Instruct.Q4_1.gguf, for `py benchmarks.gpu.engine_correctness --model ...`)
#   run SYSTEMS...   (once everything is staged) install, build native/, warm the JIT, then
#                    `python -m benchmarks.gpu.serve_h100 --systems SYSTEMS ...`; results in $OUT
#   py MODULE ARGS   the same set-up, then `python -m MODULE ARGS` (offline throughput, profile, recovery ...)
# LIMIT (default 540 s) bounds run's sweep and py's module (SIGINT at it); it is cut to what the device call leaves after the set-up
# (CALL_LIMIT, default 600: the call's timeout_s) less 75 s for the stop, the packing and the copy back.
# The carried parts exceed one call's 64 MiB, so stage runs once per part, back to back (the machine
# keeps /tmp only while it stays warm). vLLM goes to its own folder (/tmp/vsite): it brings fastapi, pydantic
# and flashinfer in other versions than Ray's and ours.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/wh /tmp/whv /tmp/site /tmp/vsite /tmp/azure
if [ "${1:-}" = stage ]; then
  for d in .carry/flashinfer-* .carry/ray-*; do [ -d "$d" ] && cp -r "$d"/* /tmp/wh/; done
  for d in .carry/vllm-*; do [ -d "$d" ] && cp -r "$d"/* /tmp/whv/; done
  [ -f .carry/fi-jit/fi_jit_cache.tgz ] && tar xzf .carry/fi-jit/fi_jit_cache.tgz -C /tmp
  [ -d .carry/azure ] && cp .carry/azure/* /tmp/azure/
  for d in .carry/smol-*; do [ -d "$d" ] && mkdir -p /tmp/smol && cp "$d"/smolpart* /tmp/smol/ \
    && { cp "$d"/gguf-*.whl /tmp/wh/ 2>/dev/null || true; }; done
  # engine.prefill_gemm's tuned choices from an earlier lease (benchmarks/results/serve_h200_m5/lt_gemm_cache_h200.json
  # copied to .carry/lt-cache/lt_gemm.json): keyed by device, cuBLASLt and torch, so a start on another kind re-times
  [ -f .carry/lt-cache/lt_gemm.json ] && mkdir -p ~/.cache/bullet_ray && cp .carry/lt-cache/lt_gemm.json ~/.cache/bullet_ray/
  echo "wheels: $(ls /tmp/wh | wc -l) ours, $(ls /tmp/whv | wc -l) vllm"; ls /tmp/azure; exit 0
fi
mode=$1; shift
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws FLASHINFER_USE_CUDA_NORM=1 VLLM_SITE=/tmp/vsite
export BULLET_RAY_TRACE_DIR=/tmp/azure  # the staged traces, for every module that reads them (offline, replay ...)
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH RAY_USAGE_STATS_ENABLED=0
join_parts() { (cd "$1" && for f in $(ls *.part.00 2>/dev/null); do cat "${f%.part.00}".part.* > "${f%.part.00}"; rm -f "${f%.part.00}".part.*; done); }
SMOL=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf  # real weights, if staged: both parts, or none
SMOL_PARTS=$(ls /tmp/smol/smolpart* 2>/dev/null | wc -l)
[ -f "$SMOL" ] || [ "$SMOL_PARTS" -lt 2 ] || cat /tmp/smol/smolpart* > "$SMOL"
[ "$SMOL_PARTS" = 1 ] && echo "SmolLM2: 1 of 2 parts staged, $SMOL not made: stage .carry/smol-a and smol-b back to back"
if [ ! -f /tmp/site/.installed ]; then
  join_parts /tmp/wh
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/wh/*.whl || exit 3
  # pip stamps what it installs with today's time: date it all back (flashinfer's sources and the
  # tvm_ffi headers its objects depend on) so the carried JIT cache's objects are newer than their inputs
  find /tmp/site -type f -exec touch -d 2026-01-01 {} +
  touch /tmp/site/.installed
fi
if [ ! -f /tmp/vsite/.installed ] && [ -n "$(ls /tmp/whv 2>/dev/null)" ]; then
  join_parts /tmp/whv
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite /tmp/whv/*.whl || exit 5
  touch /tmp/vsite/.installed
fi
# a part staged on a machine that was since given back (idle > 30 s between stage calls) leaves a wheel out:
# say so now instead of letting every system time out waiting for replicas that cannot import it
python3 -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ('flashinfer', 'ray', 'tvm_ffi')))" \
  || { echo "missing wheels in /tmp/site (flashinfer, ray, tvm_ffi): restage every .carry part back to back"; \
       rm -f /tmp/site/.installed; exit 6; }
make -s -C native >/dev/null || exit 4
[ -f /tmp/.jit_warm ] || { timeout 300 python3 -m benchmarks.gpu.warm_jit 2>&1 | tail -3; touch /tmp/.jit_warm; }
# LIMIT counts from here, but the device call's own limit (CALL_LIMIT, its timeout_s: 600 unless set lower) counts
# from the script's start: a first call spends ~110-150 s above on the install and the JIT, and a LIMIT that leaves
# no room for the stop (45 s), the packing and the copy back loses the whole call (the forty-eighth session's lease)
LIMIT=${LIMIT:-540}
ROOM=$(( ${CALL_LIMIT:-600} - SECONDS - 75 ))
[ "$ROOM" -lt 10 ] && ROOM=10  # (timeout 0 would mean none)
if [ "$LIMIT" -gt "$ROOM" ]; then
  echo "LIMIT=$LIMIT cut to $ROOM: set-up took ${SECONDS} s of the call's ${CALL_LIMIT:-600} s"; LIMIT=$ROOM
fi
if [ "$mode" = py ]; then
  # SIGINT at LIMIT: the module sees KeyboardInterrupt, so its cleanup runs and pytest still prints its summary of
  # the tests so far (with SIGTERM the fiftieth session's GPU-test call brought back only pytest's progress dots)
  NAME=$(echo "$1" | sed 's/.*\.//'); timeout -s INT -k 10 "$LIMIT" python3 -m "$@" 2>&1 | tee "$OUT/log_$NAME.txt" \
    | grep -v "it/s\]$" | tail -80
else
  # only letters, digits, '.', '_' and '-' come back from $OUT ("chunked-2048+pw1024" would not)
  # the arguments' first 50 characters and a hash of all of them: two calls that differ only late (--systems) keep
  # apart (a shared name made the second call remove the first's folder)
  NAME=$(echo "$*" | sed 's/^-*//' | tr -c 'A-Za-z0-9._\n-' '_' | cut -c1-50)_$(echo "$*" | md5sum | cut -c1-8)
  RES=/tmp/serve_out/$NAME; rm -rf "$RES"
  # at LIMIT, timeout's SIGTERM makes serve_h100 stop the server it runs (serve run, vllm serve) before it exits;
  # 45 s later it is killed whatever it is doing. A server left running would answer the next call's sweep.
  timeout -k 45 "$LIMIT" python3 -m benchmarks.gpu.serve_h100 --out "$RES" --trace-path /tmp/azure "$@" 2>&1 \
    | tee "$OUT/log_$NAME.txt" | grep -v "^\s*$" | grep -v "it/s\]$" | tail -60
  if [ "${PIPESTATUS[0]}" -ge 124 ]; then  # stopped at LIMIT: whatever outlived it would hold the next call's GPU
    echo "stopped at LIMIT=$LIMIT: ray stop --force, and any vllm serve left"
    ray stop --force >/dev/null 2>&1; pkill -f "[o]penai.api_server"
  fi
  cp "$RES"/compare.{json,md,png} "$RES"/goodput_ci.txt "$OUT/" 2>/dev/null
  tar czf "$OUT/all_$NAME.tgz" -C /tmp/serve_out "$NAME"
  (cd /tmp/ray 2>/dev/null && find session_2* -type f -size -4M \( -name "worker-*" -o -path "*/logs/serve/*" \) \
    | tar czf "$OUT/ray_logs_$NAME.tgz" -T -)
fi
ls -la "$OUT"
tar czf "$OUT/fi_jit_cache.tgz" -C /tmp fi_ws 2>/dev/null  # carry it back next time as .carry/fi-jit
