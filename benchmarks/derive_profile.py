"""A *derived* profile for a GPU nobody has swept yet, from a measured profile of a kindred one: the same model,
dtype, ladder and calibration, with the ceilings scaled. No GPU needed.

The H200 is the H100's chip with faster memory (4.8 against 3.35 TB/s by the datasheets, 1.43x; the copies
measured on this workplace's machines agree: ~4.3 TB/s on an H200, ~3.0 on an H100) and the same 132 SMs and
matrix rate. So its derived profile keeps the H100's compute ceiling and calibration, scales the bandwidth ceiling
by 1.43 and, since one SM pulls no more bytes per second on either chip, the SMs at which bandwidth saturates by
the same factor. The measured samples stay behind (they are the other GPU's steps): the serving engine's online
correction (bullet_ray.perf.calibration.online) takes what the scaling misses, and `bullet-ray profile` on the
device itself replaces the file.

    python -m benchmarks.derive_profile bullet_ray/perf/profiles/nvidia-h100-80gb-hbm3__llama-3-1-8b__bfloat16.json \
        --gpu-name "NVIDIA H200" --bandwidth-scale 1.433 --out bullet_ray/perf/profiles/
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

from bullet_ray.perf.profile import Profile, load_profile, save_profile


def derive(source: Profile, gpu_name: str, bandwidth_scale: float, compute_scale: float = 1.0,
           command: str = "") -> Profile:
    """`source` moved to `gpu_name`: peak bandwidth and saturation SMs x bandwidth_scale, peak FLOP/s x
    compute_scale, no samples, source "derived"."""
    gpu = dataclasses.replace(source.gpu, name=gpu_name,
                              peak_bandwidth_gbs=round(source.gpu.peak_bandwidth_gbs * bandwidth_scale, 1),
                              peak_tflops=round(source.gpu.peak_tflops * compute_scale, 1),
                              saturation_sms=round(source.gpu.saturation_sms * bandwidth_scale, 2))
    notes = (f"Derived from the {source.source} profile of {source.gpu.name} ({source.date}; fit "
             f"{source.fit.get('num_samples', 0)} steps) by `python -m benchmarks.derive_profile`: bandwidth and its "
             f"saturation SMs x {bandwidth_scale}, compute x {compute_scale}, the calibration kept, no samples of "
             f"this GPU. A lead until `bullet-ray profile` runs on it.")
    return dataclasses.replace(source, gpu=gpu, samples=[], fit={}, source="derived", notes=notes,
                               date=time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), command=command)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path, help="a measured profile JSON of a kindred GPU")
    parser.add_argument("--gpu-name", required=True, help="the device name as torch reports it, e.g. 'NVIDIA H200'")
    parser.add_argument("--bandwidth-scale", type=float, required=True,
                        help="memory bandwidth of the new GPU over the profiled one (> 0)")
    parser.add_argument("--compute-scale", type=float, default=1.0, help="matrix rate ratio (> 0; default 1)")
    parser.add_argument("--out", type=Path, required=True, help="folder (or file) for the derived profile")
    parser.add_argument("--model", default="dummy:llama-3.1-8b",
                        help="the profile's model, for the printed step-time predictions (default dummy:llama-3.1-8b)")
    args = parser.parse_args(argv)
    if not args.profile.is_file():
        print(f"error: profile: {args.profile} is not a file", file=sys.stderr)
        return 2
    for flag, value in (("--bandwidth-scale", args.bandwidth_scale), ("--compute-scale", args.compute_scale)):
        if not value > 0:
            print(f"error: {flag}: must be > 0, got {value}", file=sys.stderr)
            return 2
    source = load_profile(args.profile)
    command = "python -m benchmarks.derive_profile " + shlex.join(sys.argv[1:] if argv is None else argv)
    derived = derive(source, args.gpu_name, args.bandwidth_scale, args.compute_scale, command)
    path = save_profile(derived, args.out)
    print(f"{path}: {derived.gpu}")
    print(predictions(source, derived, args.model))
    return 0


def predictions(source: Profile, derived: Profile, model: str) -> str:
    """Step times (ms) both profiles predict for `model`, to hold against the new GPU's first measured steps: decode
    steps of 64 and 16 sequences x 1k context by decode SMs, a 2,048-token prefill by prefill SMs."""
    from bullet_ray.models.loader import resolve_source
    from bullet_ray.perf.model import PerfModel

    cfg = resolve_source(model).config
    old, new = PerfModel.from_profile(source, cfg), PerfModel.from_profile(derived, cfg)
    rows = [f"predicted step times, ms: {source.gpu.name} / {derived.gpu.name} ({model})"]
    for batch in (64, 16):
        for sms in (16, 32, 64, derived.gpu.sm_count):
            rows.append(f"  decode {batch} x 1k context on {sms:3d} SMs: {old.predict_decode_s(batch, batch * 1024, sms) * 1e3:6.2f}"
                        f" / {new.predict_decode_s(batch, batch * 1024, sms) * 1e3:6.2f}")
    for sms in (68, 116, derived.gpu.sm_count):
        rows.append(f"  prefill 2,048 tokens on {sms:3d} SMs: {old.predict_prefill_s(2048, sms=sms) * 1e3:6.2f}"
                    f" / {new.predict_prefill_s(2048, sms=sms) * 1e3:6.2f}")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
