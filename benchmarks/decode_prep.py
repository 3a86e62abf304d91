"""Host time of a step's preparation (`ModelRunner.build_metadata`): decode with and without the padded page table; prompt chunks' KV slots.

    python -m benchmarks.decode_prep --out benchmarks/results/decode_prep_cpu/decode_prep.json

A decode step that a CUDA graph bucket holds stages its own page indices (`DecodeGraphs._plan`), so the runner
leaves the metadata's padded block table out for it (`build_metadata(page_table=False)`). This times both on the
host alone (CPU tensors: no pinned copy, no GPU), for decode batches whose every sequence has its last token still
on the device (the asynchronous schedule's usual step: the token is gathered from the last step's ids), with
Azure-conversation-like contexts (400-1,300 tokens, 16-token blocks). On a GPU the step log's `prep_ms` is the
same call plus the pinned copies (0.80 ms at 113 sequences on the H200 host, `serve_h200_m21/`). A prompt chunk's
KV slots are computed one range per page (`runner.token_slots`); both ways are timed on chunks of `--chunk-tokens`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch


def make_batch(num_seqs: int, block_size: int, seed: int) -> tuple[list, dict[str, int]]:
    """`num_seqs` decode items (one new token each, pending on the device) and their rows in the last step's ids."""
    from bullet_ray.engine.scheduler.base import ScheduledSeq
    from bullet_ray.engine.sequence import Sequence

    rng = random.Random(seed)
    batch, rows = [], {}
    for i in range(num_seqs):
        prompt = list(range(rng.randint(300, 1100)))
        sampling = SimpleNamespace(output_token_ids=list(range(rng.randint(10, 200))), params=None)
        seq = Sequence(f"r{i}", prompt, sampling, 0.0, 16384)
        known = seq.num_known_tokens
        seq.block_ids = list(range(i * 128, i * 128 + (known + block_size) // block_size))
        seq.num_computed_tokens, seq.num_pending_tokens = known, 1
        batch.append(ScheduledSeq(seq, 1))
        rows[seq.request_id] = i
    return batch, rows


def time_prep(num_seqs: int, repeats: int, block_size: int = 16, seed: int = 0) -> dict[str, float]:
    """Median and p90 microseconds of build_metadata with and without the page table, interleaved."""
    from bullet_ray.engine.runner import ModelRunner

    runner = ModelRunner(model=None, backend=None, sampler=None, block_size=block_size, device="cpu")
    batch, rows = make_batch(num_seqs, block_size, seed)
    runner._last_rows, runner._last_ids = rows, torch.zeros(num_seqs, dtype=torch.long)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(repeats + repeats // 10):  # the first tenth warms up
        for table in (True, False):
            start = time.perf_counter()
            runner.build_metadata(batch, page_table=table)
            if i >= repeats // 10:
                times[table].append((time.perf_counter() - start) * 1e6)
    out: dict[str, float] = {"num_seqs": num_seqs}
    for table, name in ((True, "with_table"), (False, "without_table")):
        ts = sorted(times[table])
        out[f"{name}_p50_us"] = round(statistics.median(ts), 1)
        out[f"{name}_p90_us"] = round(ts[int(0.9 * len(ts))], 1)
    out["saved_p50"] = round(1 - out["without_table_p50_us"] / out["with_table_p50_us"], 3)
    return out


def time_chunk_slots(tokens: int, repeats: int, block_size: int = 16) -> dict[str, float]:
    """Median microseconds of a prompt chunk's KV slots, one Python step per token (the runner's way before
    `token_slots`) against one range per page (`token_slots`), interleaved; the chunk starts mid-page."""
    from bullet_ray.engine.runner import token_slots

    blocks = list(range(5, 5 + tokens // block_size + 2))
    start, end = 3, 3 + tokens
    times: dict[str, list[float]] = {"per_token": [], "per_page": []}
    for i in range(repeats + repeats // 10):
        for name in times:
            began = time.perf_counter()
            if name == "per_token":
                [].extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, end))
            else:
                token_slots(blocks, start, end, block_size)
            if i >= repeats // 10:
                times[name].append((time.perf_counter() - began) * 1e6)
    return {"tokens": tokens, **{f"{name}_p50_us": round(statistics.median(ts), 1) for name, ts in times.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="16,64,113,256", help="decode batch sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=2000, help="timed calls per batch size and variant")
    parser.add_argument("--chunk-tokens", default="512,2048,8192",
                        help="prompt chunk sizes whose KV slots are timed both ways, comma-separated")
    parser.add_argument("--out", default=None, help="JSON output path (default: print only)")
    args = parser.parse_args(argv)
    sizes, chunks = [], []
    for name, value, into in (("--batch-sizes", args.batch_sizes, sizes), ("--chunk-tokens", args.chunk_tokens, chunks)):
        try:
            into.extend(int(v) for v in value.split(","))
        except ValueError:
            parser.error(f"{name}: integers separated by commas, got {value!r}")
    if any(n < 1 for n in sizes + chunks) or args.repeats < 10:
        parser.error("--batch-sizes and --chunk-tokens must be >= 1, --repeats >= 10")
    rows = []
    for n in sizes:
        row = time_prep(n, args.repeats)
        rows.append(row)
        print(f"{n:4d} sequences: with the page table p50 {row['with_table_p50_us']:7.1f} us (p90 "
              f"{row['with_table_p90_us']:.1f}), without p50 {row['without_table_p50_us']:7.1f} us (p90 "
              f"{row['without_table_p90_us']:.1f}): {row['saved_p50']:.0%} less")
    chunk_rows = []
    for n in chunks:
        row = time_chunk_slots(n, max(10, args.repeats // 10))
        chunk_rows.append(row)
        print(f"{n:5d}-token prompt chunk's KV slots: per token p50 {row['per_token_p50_us']:8.1f} us, per page "
              f"{row['per_page_p50_us']:7.1f} us")
    if args.out:
        result = {
            "benchmark": "decode_prep",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": f"CPU ({os.cpu_count()} cores, {platform.machine()}, {platform.processor() or 'unknown'})",
            "torch": torch.__version__,
            "command": "python -m benchmarks.decode_prep " + " ".join(argv if argv is not None else sys.argv[1:]),
            "rows": rows,
            "chunk_slots": chunk_rows,
        }
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
