"""Decode attention alone on the GPU, one flashinfer kernel against another: how fast each reads the KV of a
decode batch (Llama-3.1-8B heads: 32 query, 8 KV, dim 128, bf16, pages of 16 tokens in a shuffled order as
a served pool holds them). Kernels: flashinfer's CUDA-core decode, its tensor-core decode on the FA2
prefill kernel (what the engine runs: backend "auto" picks fa2 for bf16) and on the FA3 (Hopper) one,
each planned once per shape, with and without split-KV, run eagerly and replayed from a CUDA graph (the
wrapper in CUDA-graph mode, as the engine's decode graphs plan it). TB/s counts the K and V bytes read.

Row lengths: `--lengths uniform` (default) gives every row the shape's context; `--lengths azure` draws each
row's context from the Azure conversation trace as a served decode batch holds it (a request's prompt plus a
uniform share of its output, capped at 16k; seeded, the same rows for every kernel), so a few long rows sit
beside many short ones and, without split-KV, the longest (row, KV head) pair can hold the kernel after the
others are done; the shape's context is then ignored except in the label (`ctx` = the drawn rows' mean).

    PYTHONPATH=$PWD python -m benchmarks.gpu.decode_attention        # prints a table, saves decode_attention.json
    PYTHONPATH=$PWD python -m benchmarks.gpu.decode_attention --lengths azure --trace-path /tmp/azure \
        --kernels tc_fa2 --shapes 16x0,24x0,32x0,48x0,64x0,96x0,128x0 --out-name decode_attention_azure
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from typing import Any

import torch

from benchmarks.gpu.common import copy_bandwidth_gbs, save

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16
KERNELS: dict[str, dict[str, Any]] = {"cuda_core": {"use_tensor_cores": False},
                                      "tc_fa2": {"use_tensor_cores": True, "backend": "fa2"},
                                      "tc_fa3": {"use_tensor_cores": True, "backend": "fa3"}}


def time_kernel(flashinfer: Any, kv: torch.Tensor, kernel: str, split_kv: bool | str | int, graph: bool, q: torch.Tensor,
                lens: list[int], page_order: torch.Tensor, repeats: int) -> tuple[float, torch.Tensor]:
    """Median ms of one layer's decode attention over rows of context `lens` (8 runs per repeat; `graph`: the
    wrapper in CUDA-graph mode, the 8 runs captured once and replayed, as the engine's decode graphs run it)."""
    pages = [(n + PAGE - 1) // PAGE for n in lens]
    indices = page_order[:sum(pages)].to(torch.int32)
    indptr = torch.tensor([0, *itertools.accumulate(pages)], device="cuda", dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(lens, pages, strict=True)], device="cuda",
                        dtype=torch.int32)
    workspace = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    buffers = {"use_cuda_graph": True, "paged_kv_indptr_buffer": indptr.clone(),
               "paged_kv_indices_buffer": indices.clone(), "paged_kv_last_page_len_buffer": last.clone()} if graph else {}
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="NHD", **KERNELS[kernel], **buffers)
    options: dict[str, Any] = {} if split_kv is True else {"disable_split_kv": True}
    if not isinstance(split_kv, bool) and isinstance(split_kv, int):  # a fixed KV chunk of this many pages
        options = {"fixed_split_size": split_kv}
    if split_kv == "balanced":  # the engine's rule (it applies it from SPLIT_KV_MAX_ROWS rows): the longest rows, evenly
        from bullet_ray.engine.attention.flashinfer_backend import balanced_kv_chunk_pages, graph_grid_chunks

        sms = torch.cuda.get_device_properties(0).multi_processor_count
        limit = graph_grid_chunks(len(lens), HEADS, KV_HEADS, sms) if graph else None
        chunk = balanced_kv_chunk_pages(pages, KV_HEADS, sms, limit)
        options = {"disable_split_kv": True} if chunk is None else {"fixed_split_size": chunk}
    wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, DIM, PAGE, q_data_type=torch.bfloat16,
                 kv_data_type=torch.bfloat16, **options)
    out = wrapper.run(q, (kv[:, 0], kv[:, 1]))

    def runs() -> None:
        for _ in range(8):
            wrapper.run(q, (kv[:, 0], kv[:, 1]), out=out)

    step = runs
    if graph:
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(g, stream=side):
            runs()
        torch.cuda.current_stream().wait_stream(side)
        step = g.replay
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 8)
    return statistics.median(times), out


def azure_row_lengths(batch: int, trace_path: str | None, seed: int, cap: int = 16384) -> list[int]:
    """Contexts of `batch` decode rows drawn from the Azure conversation trace: a request's prompt plus a
    uniform share of its output (where a served decode batch holds it), at least 1, at most `cap`."""
    import numpy as np

    from bullet_ray.bench.traces import load_azure_trace, trace_csv_path

    trace = load_azure_trace(trace_csv_path("conv", trace_path))
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, len(trace.prompt_tokens), size=batch)
    done = rng.random(batch)
    lens = trace.prompt_tokens[rows] + np.floor(done * trace.output_tokens[rows])
    return [int(min(cap, max(1, n))) for n in lens]


def main() -> None:
    import flashinfer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="16x1024,64x1300,128x1300,256x1300,384x1180,16x4096,64x4096",
                        help="batch x context, comma-separated")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--lengths", choices=("uniform", "azure"), default="uniform",
                        help="uniform: every row the shape's context; azure: rows drawn from the conversation trace")
    parser.add_argument("--trace-path", default=None, help="the Azure trace folder or conv.csv (--lengths azure)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--balanced", action="store_true",
                        help="also time the engine's balanced split (tc_fa2: fixed KV chunks for the longest rows)")
    parser.add_argument("--split-pages", default="",
                        help="also time tc_fa2 with these fixed KV chunks (pages, comma-separated), e.g. 4,8,16")
    parser.add_argument("--out-name", default="decode_attention", help="the saved JSON's name (without .json)")
    args = parser.parse_args()
    copy_gbs = copy_bandwidth_gbs()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    row_lens = {(b, c): azure_row_lengths(b, args.trace_path, args.seed + b) if args.lengths == "azure" else [c] * b
                for b, c in shapes}
    max_pages = max(sum((n + PAGE - 1) // PAGE for n in lens) for lens in row_lens.values())
    kv = torch.randn(max_pages, 2, PAGE, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    page_order = torch.randperm(max_pages, device="cuda")
    rows = []
    for batch, shape_ctx in shapes:
        lens = row_lens[(batch, shape_ctx)]
        ctx = round(sum(lens) / batch)
        kv_bytes = sum(lens) * KV_HEADS * DIM * 2 * 2
        ref = None
        q = torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        splits: tuple[bool | str | int, ...] = (True, False, "balanced") if args.balanced else (True, False)
        splits += tuple(int(p) for p in args.split_pages.split(",") if p)
        for kernel, split_kv, graph in itertools.product(args.kernels.split(","), splits, (False, True)):
            if (split_kv == "balanced" or not isinstance(split_kv, bool)) and kernel != "tc_fa2":
                continue
            row: dict[str, Any] = {"batch": batch, "ctx": ctx, "max_ctx": max(lens), "kernel": kernel,
                                   "split_kv": split_kv, "graph": graph}
            try:
                ms, out = time_kernel(flashinfer, kv, kernel, split_kv, graph, q, lens, page_order, args.repeats)
            except Exception as e:  # noqa: BLE001 - a kernel this flashinfer build refuses: report it
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                print(batch, ctx, kernel, split_kv, graph, row["error"], flush=True)
                rows.append(row)
                continue
            ref = out.float() if ref is None else ref
            row.update(us=round(ms * 1e3, 1), kv_tbs=round(kv_bytes / (ms / 1e3) / 1e12, 3),
                       kv_frac=round(kv_bytes / (ms / 1e3) / 1e9 / copy_gbs, 3),
                       rel_diff=float((out.float() - ref).norm() / ref.norm()))
            rows.append(row)
            print(f"{batch:4d} x {ctx:5d} (max {max(lens):5d}) {kernel:9s} split_kv={split_kv!s:8s} graph={graph!s:5s} {row['us']:9.1f} us "
                  f"{row['kv_tbs']:.2f} TB/s ({row['kv_frac']:.2f})  rel {row['rel_diff']:.1e}", flush=True)
    save(args.out_name, {"copy_gbs": copy_gbs, "lengths": args.lengths, "seed": args.seed, "rows": rows})


if __name__ == "__main__":
    main()
