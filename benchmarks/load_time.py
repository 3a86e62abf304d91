"""First and second load time of the embedded model (GGUF dequantization vs the cached HF folder).

    python -m benchmarks.load_time --out benchmarks/results/load_time_cpu.json

Uses a fresh cache folder so the first load really dequantizes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/load_time_cpu.json", help="JSON output path")
    args = parser.parse_args(argv)
    os.environ["BULLET_RAY_CACHE_DIR"] = tempfile.mkdtemp(prefix="bullet_ray_cache_")
    from bullet_ray.models.loader import load_model

    times = []
    for _ in range(2):
        start = time.perf_counter()
        load_model("smollm2-135m-instruct", show_progress=True)
        times.append(time.perf_counter() - start)
    result = {
        "benchmark": "load_time", "model": "smollm2-135m-instruct",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"CPU ({os.cpu_count()} cores, {platform.machine()})",
        "command": "python -m benchmarks.load_time " + " ".join(argv if argv is not None else sys.argv[1:]),
        "first_load_s": round(times[0], 2), "second_load_s": round(times[1], 2),
        "note": "first: dequantize the GGUF and write the cached HF folder; second: read the cached folder",
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"first load {times[0]:.1f} s, second load {times[1]:.1f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
