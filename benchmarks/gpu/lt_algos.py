"""Among the algorithms cuBLASLt offers for the prefill projections, does one keep the whole GPU's per-SM speed on a
green-context partition?

Why: a 2,048-token prefill step of Llama-3.1-8B takes ~50 ms on the whole 132-SM H200 and ~65-72 ms on any
partition of 84-124 SMs (a green context holding all 132 SMs is as fast as the whole GPU: the partition's size is
the cost, not the green context). cuBLAS's chosen kernels (`nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT`, grid
[2,66,1] = 132 CTAs in clusters of 2) are persistent kernels sized for 132 SMs: on 116 SMs they take two rounds of
CTAs (~1.74x). CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET made cuBLAS pick other kernels but gained only ~5-10%, and a
Triton tile-per-program GEMM is 0.6-0.77x of cuBLAS even on the whole GPU.

What it measures, per place (the whole GPU; the prefill stream of a green partition per `--decode-sms` entry;
with `--green-whole` a green context holding every SM) x `--tokens` x projection (qkv, o, gate_up, down of
`--model`): `F.linear` (the baseline), then every algorithm cuBLASLt's heuristic returns (up to `--algos`) for the
same GEMM, queried twice: without an SM-count target and with SM_COUNT_TARGET = the place's SMs (one query on a
place holding every SM); the first four of each query also with clusters of 1x1, 1x2 and 2x1 (`cluster_variants`,
the engine's `prefill_gemm: cublaslt` tries the same). Each algorithm runs with the descriptor it was found with (the target may change the
launch as well as the choice), its output checked against `F.linear` (relative max error), timed with CUDA
events on the place's stream over `--repeats` back-to-back launches. An algorithm that fails is recorded with its
status. JSON: every algorithm's configuration (algo/tile/stages/cluster/split-K/reduction/swizzle/custom option),
waves count, workspace, ms, TFLOP/s, error; the best one's speedup over `F.linear`. The table at the end gives per
point the best algorithm's TFLOP/s per SM against the whole GPU's best.

    bash benchmarks/gpu/run_serve_h100.sh py benchmarks.gpu.lt_algos --decode-sms 16,64 --green-whole --step \
        --out $OUT/lt_algos.json

With `--enumerate`, each descriptor (with and without the target) is also searched the way NVIDIA's cuBLASLt
auto-tuning samples do, for kernels the heuristic never offers (a grid of output tiles, or 1x1 / 1x2 clusters sized
for the partition): cublasLtMatmulAlgoGetIds -> cublasLtMatmulAlgoInit per id -> its capabilities (tile ids, stages
ids, split-K, CTA swizzling, custom option max; cuBLASLt lists no cluster shapes, so `--clusters` are tried on
every configuration and the check rejects the invalid) -> bounded configurations (`enumerate_configs`) ->
cublasLtMatmulAlgoCheck. Bounds: tiles with both sides >= `--min-tile` (64), largest first; per tile at most
`--max-stages` (4) stages ids, the AUTO ones first, then spread over the rest; clusters auto,1x1x1,1x2x1,2x1x1;
swizzle 0 and 1 where supported; SPLITK_NUM `--splitk` (1: none); CUSTOM_OPTION 0..`--custom-options` (0); the
algorithm ids take turns and at most `--max-checks` (10,000) are checked per descriptor. The valid ones that need
at most the workspace and that the heuristic did not return (same 64 bytes) are timed like the heuristic's, the
first `--max-candidates` (200) per point in check order, split evenly between its descriptors; each algorithm in the
JSON says its `source` (heuristic / enumerated), `enumeration` gives per descriptor the ids, combinations, checked,
valid, new, timed, the check statuses and seconds, and `best` (and the table) considers and names both sources.

With `--step`, each place's whole prefill step is also timed plain and with every projection whose best algorithm
beat `F.linear` launched with it through the engine's own router (`routed_step`: `bullet_ray.engine.lt_gemm`'s
`LtGemmRouter`, as `engine.prefill_gemm: cublaslt` runs it; the JSON's `algo_hex` keeps each algorithm's 64 bytes).

The GEMM is `F.linear(x, w)`: x [M=T, K], w [N, K], y [M, N], bf16, row-major. In cuBLASLt's column-major terms
D (N x M, ld N) = op(A) op(B) with A = w as K x N (ld K, TRANSA = T) and B = x as K x M (ld K, TRANSB = N);
compute CUBLAS_COMPUTE_32F, scale CUDA_R_32F, alpha 1, beta 0, C = D.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bullet_ray.engine.lt_gemm import Choice, LtGemmRouter, LtLib, place_key, rel_error
from bullet_ray.engine.lt_gemm.tuner import VARIANT_SOURCES
from bullet_ray.engine.lt_gemm.tuner import cluster_variants as engine_cluster_variants
from bullet_ray.gpu.cublaslt import (
    CUBLAS_STATUS_SUCCESS,
    STATUS_NAMES,
    CublasLtError,
    LinearGemm,
    MatmulAlgo,
    algo_key,
    check,
    dedupe,
    describe,
    load_cublaslt,
    with_cluster,
)
from bullet_ray.gpu.cublaslt_ids import CLUSTER_IDS, EnumBounds


def enumeration_bounds(args: argparse.Namespace) -> EnumBounds:
    """EnumBounds from the --enumerate flags; ValueError names a cluster shape cublasLtClusterShape_t lacks."""
    names = [c for c in args.clusters.split(",") if c]
    unknown = [c for c in names if c not in CLUSTER_IDS]
    if unknown:
        raise ValueError(f"--clusters: unknown {','.join(unknown)}; the known shapes: {','.join(CLUSTER_IDS)}")
    return EnumBounds(min_tile=args.min_tile, max_stages=args.max_stages, max_checks=args.max_checks,
                      splitk_nums=tuple(int(k) for k in args.splitk.split(",") if k),
                      cluster_shape_ids=tuple(CLUSTER_IDS[c] for c in names), max_custom_option=args.custom_options)


def enumerated(gemm: LinearGemm, target: int, heuristic_keys: set[bytes], ws_bytes: int, max_candidates: int,
               args: argparse.Namespace, row: dict[str, Any]) -> list[tuple[str, int, Any]]:
    """("enumerated", rank in check order, result) of the first `max_candidates` configurations `gemm.enumerate` found
    valid that the heuristic did not return (same 64 bytes); the counts go to row["enumeration"]."""
    start = time.perf_counter()
    found = gemm.enumerate(enumeration_bounds(args), ws_bytes)
    seen = set(heuristic_keys)
    out: list[tuple[str, int, Any]] = []
    for rank, r in enumerate(found.results):
        if algo_key(r.algo) not in seen:
            seen.add(algo_key(r.algo))
            if len(out) < max_candidates:
                out.append(("enumerated", rank, r))
    row.setdefault("enumeration", []).append(
        {"sm_target": target, "algo_ids": found.num_algo_ids, "combinations": found.num_combinations,
         "checked": found.num_checked, "valid": len(found.results), "new": len(seen) - len(heuristic_keys),
         "timed": len(out), "check_statuses": found.check_statuses, "errors": found.errors,
         "seconds": round(time.perf_counter() - start, 3)})
    return out


def cluster_variants(lib: ctypes.CDLL, gemm: LinearGemm, sources: list[Any], known: set[bytes],
                     ws_bytes: int) -> list[tuple[str, int, Any]]:
    """("cluster_variant", rank of the source, result) of each source algorithm (heuristic results) with each of
    lt_gemm's CLUSTER_VARIANTS cluster shapes that is new and that cublasLtMatmulAlgoCheck accepts within the
    workspace (the engine's tuner tries the same: `lt_gemm.tuner.cluster_variants`)."""
    out: list[tuple[str, int, Any]] = []
    for rank, raw in engine_cluster_variants(functools.partial(with_cluster, lib), [bytes(r.algo) for r in sources],
                                             set(known)):
        status, result = gemm.check_algo(MatmulAlgo.from_buffer_copy(raw))
        if status == CUBLAS_STATUS_SUCCESS and result.workspaceSize <= ws_bytes:
            out.append(("cluster_variant", rank, result))
    return out


def sweep_point(lib: ctypes.CDLL, handle: ctypes.c_void_p, place: tuple[str, int, Any], sm_count: int, m: int,
                n: int, k: int, workspace: Any, args: argparse.Namespace) -> dict[str, Any]:
    """F.linear, every heuristic algorithm and (--enumerate) the enumerated ones for one GEMM on one place (label, SMs,
    stream or None)."""
    import torch
    import torch.nn.functional as F

    from benchmarks.gpu.common import on_stream, time_back_to_back

    label, sms, stream = place
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()  # made on the default stream, read on the place's
    flops = 2 * m * n * k
    run_ref, sync = on_stream(lambda: F.linear(x, w), stream)
    ref = run_ref()
    sync()
    base_ms = time_back_to_back(lambda: F.linear(x, w), args.repeats, args.warmup, stream)
    row: dict[str, Any] = {"place": label, "sms": sms, "tokens": m, "n": n, "k": k,
                           "f_linear": {"ms": round(base_ms, 4), "tflops": round(flops / base_ms / 1e9, 1)},
                           "algos": []}
    cuda_stream = (stream or torch.cuda.current_stream()).cuda_stream
    ws_bytes = workspace.numel()
    targets = [0] if sms >= sm_count else [0, sms]  # a target equal to the device's SMs is the default query
    keys: dict[int, set[bytes]] = {}
    for target in targets:
        try:
            gemm = LinearGemm(lib, handle, m, n, k, target)
        except CublasLtError as e:
            row.setdefault("errors", []).append(f"sm_target {target}: {e}")
            continue
        try:
            found = gemm.heuristics(ws_bytes, args.algos)
            keys[target] = {algo_key(r.algo) for r in found}
            candidates = [("heuristic", rank, r) for rank, r in dedupe(found)]
            candidates += cluster_variants(lib, gemm, [r for _, _, r in candidates[:VARIANT_SOURCES]], keys[target],
                                           ws_bytes)
            keys[target] |= {algo_key(r.algo) for source, _, r in candidates if source == "cluster_variant"}
            if args.enumerate:
                candidates += enumerated(gemm, target, keys[target], ws_bytes, args.max_candidates // len(targets),
                                         args, row)
            for source, rank, r in candidates:
                config = describe(lib, r.algo)
                entry: dict[str, Any] = {"source": source, "sm_target": target, "rank": rank, "label": config.label,
                                         "config": asdict(config), "waves": round(r.wavesCount, 3),
                                         "workspace_bytes": r.workspaceSize, "algo_hex": bytes(r.algo).hex()}
                row["algos"].append(entry)
                if r.workspaceSize > ws_bytes:
                    entry["skipped"] = f"needs {r.workspaceSize} B of workspace, over --max-workspace-mib"
                    continue

                def launch(algo: MatmulAlgo = r.algo, gemm: LinearGemm = gemm) -> int:
                    return gemm.run(algo, w.data_ptr(), x.data_ptr(), y.data_ptr(), workspace.data_ptr(), ws_bytes,
                                    cuda_stream)
                y.zero_()
                torch.cuda.synchronize()
                status = launch()
                sync()
                if status != CUBLAS_STATUS_SUCCESS:
                    entry["status"] = f"CUBLAS_STATUS_{STATUS_NAMES.get(status, status)}"
                    continue
                entry["rel_err"] = round(rel_error(y, ref), 5)
                ms = time_back_to_back(launch, args.repeats, args.warmup, stream)
                entry |= {"status": "SUCCESS", "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
        except CublasLtError as e:
            row.setdefault("errors", []).append(f"sm_target {target}: {e}")
        finally:
            gemm.close()
    if len(keys) == 2:
        row["same_algos_with_target"] = len(keys[0] & keys[targets[1]])
    ran = [a for a in row["algos"] if "ms" in a and a["rel_err"] <= args.max_rel_err]
    best = min(ran, key=lambda a: a["ms"]) if ran else None
    row["best"] = None if best is None else {key: best[key] for key in ("source", "label", "sm_target", "rank", "ms",
                                                                         "tflops", "algo_hex")}
    row["best_over_f_linear"] = None if best is None else round(base_ms / best["ms"], 3)
    return row


def routed_step(bench: Any, rows: list[dict[str, Any]], stream: Any, repeats: int, lt: LtLib) -> dict[str, Any]:
    """One place's prefill step (`rows`: its sweep points at one token count), plain and with every projection whose
    best algorithm beat F.linear launched with it through the engine's own router (`LtGemmRouter`, as
    `engine.prefill_gemm: cublaslt` runs it: the descriptor it was found with, checked for the step's rows), and the
    two steps' logits compared. The router's call counts say what ran where."""
    from benchmarks.gpu.common import on_stream
    from bullet_ray.perf.sweep import _time_s

    place, sms, n_rows = rows[0]["place"], rows[0]["sms"], rows[0]["tokens"]
    chosen = {r["proj"]: r for r in rows if r["best"] is not None and (r["best_over_f_linear"] or 0) > 1.0}
    key = place_key(stream)
    choices = {(key, r["n"], r["k"]): [Choice(n_rows, bytes.fromhex(r["best"]["algo_hex"]), r["best"]["sm_target"],
                                              r["best"]["ms"], r["f_linear"]["ms"], r["best"]["label"],
                                              r["best"]["source"])] for r in chosen.values()}
    # one place, on one stream, nothing captured: the key and the launch stream are the place's
    router = LtGemmRouter(lt, choices, place_of=lambda: key, stream_of=lambda: key)
    run, sync = on_stream(bench.step_fn(bench.batch(1, n_rows, 0), 0), stream)
    plain_logits = run()
    plain = _time_s(run, sync, repeats, 2)
    router.route(bench.model, only={(r["n"], r["k"]) for r in chosen.values()})  # the others keep their own forward
    try:
        routed_logits = run()
        sync()
        routed = _time_s(run, sync, repeats, 2)
    finally:
        router.close()  # unrouted, descriptors closed (lt's handle is main's to destroy)
    return {"place": place, "sms": sms, "tokens": n_rows, "plain_ms": round(plain * 1e3, 3),
            "routed_ms": round(routed * 1e3, 3), "speedup": round(plain / routed, 3), "routed_projs": sorted(chosen),
            "tokens_per_s": {"plain": round(n_rows / plain), "routed": round(n_rows / routed)},
            "router_calls": dict(router.calls), "logits_rel_err": rel_error(routed_logits, plain_logits)}


def print_table(results: list[dict[str, Any]]) -> None:
    whole = {(r["tokens"], r["proj"]): r for r in results if r["place"] == "whole"}
    print(f"\n{'place':12} {'T':>5} {'proj':8} {'F.linear':>8} {'best':>6}  {'speedup':>7} {'per-SM':>6}  "
          "best algorithm (TFLOP/s; per-SM: best TFLOP/s per SM / the whole GPU's best per SM)")
    for r in results:
        best, ref = r["best"], whole.get((r["tokens"], r["proj"]))
        per_sm = "-"
        if best and ref and ref["best"]:
            per_sm = f"{best['tflops'] / r['sms'] / (ref['best']['tflops'] / ref['sms']):.2f}"
        speed = "-" if r["best_over_f_linear"] is None else f"{r['best_over_f_linear']:.2f}x"
        target = f" ({best['source']}, target {best['sm_target']}, rank {best['rank']})" if best else ""
        print(f"{r['place']:12} {r['tokens']:>5} {r['proj']:8} {r['f_linear']['tflops']:>8} "
              f"{best['tflops'] if best else '-':>6}  {speed:>7} {per_sm:>6}  "
              f"{best['label'] if best else 'none ran'}{target}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dummy:llama-3.1-8b", help="whose projection shapes (qkv, o, gate_up, down)")
    parser.add_argument("--decode-sms", default="16,64",
                        help="ladder entries (decode SMs), each its own green partitioner; the prefill side gets the "
                             "rest and is the place timed")
    parser.add_argument("--tokens", default="2048", help="rows T of every projection, comma-separated")
    parser.add_argument("--repeats", type=int, default=20, help="back-to-back launches timed per algorithm (mean)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed launches first")
    parser.add_argument("--algos", type=int, default=64, help="heuristic results requested per query")
    parser.add_argument("--max-workspace-mib", type=int, default=64,
                        help="workspace offered to cuBLASLt (MiB); the heuristic returns no algorithm needing more")
    parser.add_argument("--max-rel-err", type=float, default=0.02,
                        help="an algorithm counts for 'best' only if its max error relative to F.linear's largest "
                             "output is at most this")
    parser.add_argument("--green-whole", action="store_true",
                        help="also a place 'green<all SMs>': a green context holding every SM")
    parser.add_argument("--step", action="store_true",
                        help="also time a whole prefill step (one fresh sequence of T tokens, eager) per place and T, "
                             "plain and with every projection whose best algorithm beat F.linear launched with it")
    parser.add_argument("--enumerate", action="store_true",
                        help="also enumerate algorithms (cublasLtMatmulAlgoGetIds -> Init -> capabilities -> bounded "
                             "configurations -> cublasLtMatmulAlgoCheck) and time the valid ones the heuristic missed")
    parser.add_argument("--min-tile", type=int, default=64, help="--enumerate: tiles with both sides at least this")
    parser.add_argument("--max-stages", type=int, default=4,
                        help="--enumerate: stages ids per tile (the AUTO ones first, then spread over the list)")
    parser.add_argument("--clusters", default="auto,1x1x1,1x2x1,2x1x1",
                        help="--enumerate: cluster shapes tried on every configuration (cuBLASLt lists none)")
    parser.add_argument("--splitk", default="1", help="--enumerate: SPLITK_NUM values, comma-separated")
    parser.add_argument("--custom-options", type=int, default=0, help="--enumerate: CUSTOM_OPTION 0 up to this")
    parser.add_argument("--max-checks", type=int, default=10_000,
                        help="--enumerate: configurations checked per descriptor (algorithm ids take turns)")
    parser.add_argument("--max-candidates", type=int, default=200,
                        help="--enumerate: valid configurations timed per point (split evenly between its "
                             "descriptors), the first in check order")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")) / "lt_algos.json",
                        help="the JSON (default $OUT/lt_algos.json, or /tmp/out/lt_algos.json without $OUT)")
    args = parser.parse_args(argv)
    try:
        enumeration_bounds(args)
    except ValueError as e:
        parser.error(str(e))

    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    from benchmarks.gpu.common import partition_places
    from benchmarks.gpu.prefill_kernels import projections
    from bullet_ray.models.loader import resolve_source

    torch.cuda.init()
    probe = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    F.linear(probe, probe)  # torch loads cuBLAS / cuBLASLt now
    torch.cuda.synchronize()
    lib, lib_path = load_cublaslt()
    handle = ctypes.c_void_p()
    check(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    places, close_places = partition_places([int(c) for c in args.decode_sms.split(",") if c], args.green_whole)
    shapes = projections(resolve_source(args.model).config)
    tokens = [int(t) for t in args.tokens.split(",") if t]
    workspace = torch.empty(args.max_workspace_mib << 20, dtype=torch.uint8, device="cuda")
    # the engine's router (--step) over this handle and workspace: the same launches prefill_gemm: cublaslt makes
    engine_lt = LtLib(functools.partial(LinearGemm, lib, handle), workspace,
                      lambda raw: describe(lib, MatmulAlgo.from_buffer_copy(raw)).label)
    bench = None
    if args.step:
        from bullet_ray.perf.sweep import Bench

        bench = Bench(args.model, "cuda", "bfloat16", kv_fraction=0.4, use_graphs=False)
    out: dict[str, Any] = {
        "benchmark": "lt_algos", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python -m benchmarks.gpu.lt_algos " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": {"name": torch.cuda.get_device_name(0), "sms": sm_count, "torch": torch.__version__,
                   "cublaslt_version": lib.cublasLtGetVersion(), "cublaslt_cudart": lib.cublasLtGetCudartVersion(),
                   "cublaslt_path": lib_path},
        "results": [], "steps": []}
    results: list[dict[str, Any]] = out["results"]
    steps: list[dict[str, Any]] = out["steps"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    points = [(place, t, proj) for place in places for t in tokens for proj in shapes]
    try:
        for place, t, proj in tqdm(points, desc="points"):
            k, n = shapes[proj]
            row = sweep_point(lib, handle, place, sm_count, t, n, k, workspace, args)
            results.append({"proj": proj, **row})
            args.out.write_text(json.dumps(out, indent=1))  # after every point: a crash keeps what ran
            tqdm.write(f"{place[0]} T={t} {proj}: F.linear {row['f_linear']['tflops']} TFLOP/s, {len(row['algos'])} "
                       f"algos, best {row['best'] and row['best']['label']} ({row['best_over_f_linear']}x)")
            if bench is not None and proj == list(shapes)[-1]:  # the place's last projection at this T: its step
                mine = [r for r in results if r["place"] == place[0] and r["tokens"] == t]
                steps.append(routed_step(bench, mine, place[2], args.repeats, engine_lt))
                args.out.write_text(json.dumps(out, indent=1))
                tqdm.write(f"step {json.dumps(steps[-1])}")
    finally:
        close_places()
        lib.cublasLtDestroy(handle)
    print_table(results)
    for st in steps:
        print(f"step {st['place']:12} T {st['tokens']:>5}: F.linear {st['plain_ms']:.2f} ms, with the best algorithm "
              f"for {','.join(st['routed_projs']) or 'none'} {st['routed_ms']:.2f} ms ({st['speedup']:.3f}x; logits rel "
              f"err {st['logits_rel_err']:.1e})")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
