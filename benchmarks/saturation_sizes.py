"""Where the split policy's prefill batches stop growing, by profile: `PerfModel.saturation_tokens` (the fewest tokens
whose throughput is within a share of the best, as `BulletPolicy.saturation_tokens` asks it, beside a busy decode
side, before any online correction) for each profile, share (`engine.prefill_saturation_share`) and prefill SM
count. No GPU needed.

    python -m benchmarks.saturation_sizes bullet_ray/perf/profiles/nvidia-h200__llama-3-1-8b__bfloat16.json \\
        benchmarks/results/derived_h200_profile/nvidia-h200__llama-3-1-8b__bfloat16.json \\
        > benchmarks/results/replay_share_m11/saturation_sizes.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bullet_ray.config import EngineConfig
from bullet_ray.errors import ConfigError
from bullet_ray.perf.model import PerfModel
from bullet_ray.perf.profile import load_profile


def sizes(model: PerfModel, shares: list[float], sms: list[int], token_cap: int) -> dict[float, list[int]]:
    """share -> the saturation size on each of `sms`: BulletPolicy.saturation_tokens of the policy an engine with that
    share and token cap builds (EngineConfig.bullet_policy; the ladder does not enter it), beside a busy decode side."""
    out = {}
    for share in shares:
        cfg = EngineConfig(max_num_batched_tokens=token_cap, prefill_saturation_share=share)
        policy = cfg.bullet_policy(model, [16], 132)
        out[share] = [policy.saturation_tokens(n, other_busy=True, now_s=0.0) for n in sms]
    return out


def _numbers(text: str, kind: type) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profiles", nargs="+", type=Path, help="profile JSON files (samples not needed)")
    parser.add_argument("--model", default="dummy:llama-3.1-8b", help="the profiles' model (its config)")
    parser.add_argument("--shares", default="0.95,0.98,0.99", help="comma-separated shares in (0, 1]")
    parser.add_argument("--sms", default="92,100,108,116", help="comma-separated prefill SM counts")
    parser.add_argument("--token-cap", type=int, default=8192,
                        help="engine.max_num_batched_tokens (default 8192, the GPU deployments')")
    args = parser.parse_args(argv)
    try:
        shares, sms = _numbers(args.shares, float), _numbers(args.sms, int)
        for share in shares:  # the configs `sizes` builds
            EngineConfig(max_num_batched_tokens=args.token_cap, prefill_saturation_share=share)
    except (ValueError, ConfigError) as e:  # ValueError: not numbers; ConfigError: a share or the cap out of range
        print(f"saturation_sizes: error: --shares / --sms / --token-cap: {e}", file=sys.stderr)
        return 2
    if not shares or not sms or min(sms) < 1:
        print("saturation_sizes: error: --shares / --sms: need at least one share and SM counts >= 1", file=sys.stderr)
        return 2
    from bullet_ray.models.loader import resolve_source

    cfg = resolve_source(args.model).config
    print(f"saturation size (tokens) beside a busy decode side, no online correction, token cap {args.token_cap}\n")
    print("| profile | source, date | share | " + " | ".join(f"{n} SMs" for n in sms) + " |")
    print("|---|---|---|" + "---|" * len(sms))
    for path in args.profiles:
        if not path.is_file():
            print(f"saturation_sizes: error: {path} is not a file", file=sys.stderr)
            return 2
        profile = load_profile(path)
        for share, row in sizes(PerfModel.from_profile(profile, cfg), shares, sms, args.token_cap).items():
            print(f"| {path} | {profile.source}, {profile.date} | {share:g} | " + " | ".join(f"{t:,}" for t in row)
                  + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
