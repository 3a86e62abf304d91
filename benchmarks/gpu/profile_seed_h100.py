"""The derived seed of the H100 + Llama-3.1-8B profile, shipped until the first `bullet-ray profile` sweep
replaced it (2026-11-26, benchmarks/results/lease_m2l/): calibration derived from earlier H100 measurements,
kept to compare with (docs/policy.md section 2). It never writes into the package's profiles.
Where each number comes from (all on the project's H100 80GB HBM3, bf16, dummy Llama-3.1-8B weights):
- ceilings: bf16 GEMM 8192^3 on the whole GPU 784 TFLOP/s and the decode-like GEMV (64 x 4096 @ 4096 x 14336,
  weights rotated past L2) 2616 GB/s, and the GEMV on 8/16/32/48/72 SMs (708/1335/1972/2210/2461 GB/s) to
  which saturation_sms and knee are fitted: shared/GPU.md, 2026-11-22;
- samples (132 SMs, the other side idle): prefill steps of 1024/4096/16384 tokens in 2048-token prompts
  (eager, `prefill.*.ms`) and decode steps at batch 1/16/64/256 x context 1024/4096 replayed through the
  decode CUDA graphs one step at a time with the host's plan (`decode_cuda_graphs.*.ms`, what a worker's
  step measures): benchmarks/results/gpu_engine_speed_h100.json (2026-11-22T23:38);
- co-run slowdowns: two MPS processes on a complementary 32/100 split, bf16 GEMMs started together:
  decode side +8.9%, prefill side +10.9% (benchmarks/results/sm_partition_h100.json, `two_process`);
- not used: gpu_split_trace_h100_undamped.json.gz (decode steps at 64 SMs by batch size) records no
  context lengths, so its steps cannot be placed in the model; it is the check to make after a sweep.
Calibration factors of other SM counts come from the roofline's scaling alone until a sweep measures them.

    python -m benchmarks.gpu.profile_seed_h100 --out /tmp/seed/     # writes <dir>/nvidia-h100-...json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bullet_ray.models.config import ModelConfig
from bullet_ray.perf.calibration.factors import Calibration, PhaseCalibration
from bullet_ray.perf.kernels import StepShape
from bullet_ray.perf.model import PerfModel, profile_fit
from bullet_ray.perf.profile import PACKAGE_DIR, Profile, Sample, model_fingerprint, save_profile
from bullet_ray.perf.roofline import H100_SXM

ROOT = Path(__file__).resolve().parents[2]
SPEED = ROOT / "benchmarks" / "results" / "gpu_engine_speed_h100.json"
PARTITION = ROOT / "benchmarks" / "results" / "sm_partition_h100.json"


def _sample(shape: StepShape, seconds: float) -> Sample:
    return Sample(shape.phase, shape.num_tokens, shape.num_seqs, shape.num_context_tokens, shape.num_attention_pairs,
                  H100_SXM.sm_count, False, seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder (or file) for the seed profile; not the "
                                                                 "package's profiles, which hold the measured one")
    args = parser.parse_args(argv)
    if args.out.resolve() == PACKAGE_DIR.resolve() or args.out.resolve().parent == PACKAGE_DIR.resolve():
        print(f"error: --out: {args.out} is the package's profiles folder (the measured profile lives there)",
              file=sys.stderr)
        return 2
    cfg = ModelConfig.from_hf_dict(json.loads((ROOT / "bullet_ray/models/presets/llama-3.1-8b.json").read_text()))
    speed = json.loads(SPEED.read_text())
    corun = json.loads(PARTITION.read_text())["two_process"]["slowdown_together"]
    samples = []
    for tokens, rec in speed["prefill"].items():
        n = int(tokens)
        seq = min(n, 2048)
        samples.append(_sample(StepShape.of_prompts([seq] * (n // seq)), rec["ms"] / 1e3))
    for key, rec in speed["decode_cuda_graphs"].items():
        if not isinstance(rec, dict):
            continue
        bs, ctx = (int(p[2:] if p.startswith("bs") else p[3:]) for p in key.split("_"))
        samples.append(_sample(StepShape.decode(bs, bs * ctx), rec["ms"] / 1e3))
    model = PerfModel(cfg, H100_SXM)
    fitted = model.fit(samples)
    model.calibration = Calibration(
        PhaseCalibration(fitted.prefill.overhead_s, fitted.prefill.linear, fitted.prefill.attention, corun["prefill"]),
        PhaseCalibration(fitted.decode.overhead_s, fitted.decode.linear, fitted.decode.attention, corun["decode"]))
    fit = profile_fit(model, samples)
    profile = Profile(H100_SXM, {"name": "llama-3.1-8b", **model_fingerprint(cfg)}, "bfloat16",
                      list(range(16, 113, 8)), model.calibration, samples, "2026-11-23",
                      "python -m benchmarks.gpu.profile_seed_h100", "derived", (__doc__ or "").split("\n\n    ")[0], fit)
    if not args.out.suffix:  # a folder
        args.out.mkdir(parents=True, exist_ok=True)
    path = save_profile(profile, args.out)
    print(f"wrote {path}\ncalibration {model.calibration.to_dict()}\nfit {fit}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
