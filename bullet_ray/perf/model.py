"""PerfModel: predicted prefill and decode step times on any SM count, calibrated and corrected online.

    predicted(shape, n, other_busy, entry) = calibration(phase).time_s(T_linear(n), T_attention(n), other_busy)
                                             x online.factor(phase, entry, size)

(size: the step's new tokens for prefill, its batch for decode; calibration/online.py)

T_* are sums of per-kernel-class roofline times (bullet_ray.perf.kernels, bullet_ray.perf.roofline).
`from_profile` builds one from a `bullet-ray profile` file; `default` from the roofline alone (factors 1,
no overhead) for a device without one. Pure Python; a prediction costs ~10 us.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from bullet_ray.models.config import ModelConfig
from bullet_ray.perf.calibration.factors import Calibration
from bullet_ray.perf.calibration.fit import Observation, fit_calibration
from bullet_ray.perf.calibration.online import OnlineCorrection
from bullet_ray.perf.kernels import KernelClass, Phase, StepShape, kernel_costs
from bullet_ray.perf.profile import Profile, Sample
from bullet_ray.perf.roofline import GpuSpec, roofline_time_s

logger = logging.getLogger(__name__)


# where a prefill batch stops growing: the fewest tokens whose throughput the model puts within this share of the
# best (saturation_tokens' default; EngineConfig.prefill_saturation_share's and BulletPolicy's)
SATURATION_SHARE = 0.95


@dataclass(frozen=True)
class StepPrediction:
    phase: Phase
    seconds: float  # the corrected prediction
    calibrated_s: float  # before the online correction (what the correction compares the measurement with)
    sms: int


class PerfModel:
    def __init__(self, cfg: ModelConfig, gpu: GpuSpec, calibration: Calibration | None = None,
                 dtype_bytes: int = 2, online: OnlineCorrection | None = None) -> None:
        self.cfg = cfg
        self.gpu = gpu
        self.calibration = calibration or Calibration()
        self.dtype_bytes = dtype_bytes
        self.online = online or OnlineCorrection()
        self._coef = _linear_coefficients(cfg, dtype_bytes)
        self._ceilings: dict[float, tuple[float, float]] = {}

    @classmethod
    def from_profile(cls, profile: Profile, cfg: ModelConfig, refit: bool = False) -> PerfModel:
        """The profile's fitted factors (`refit`: fit them again from its samples)."""
        bytes_per = {"bfloat16": 2, "float16": 2, "float32": 4}.get(profile.dtype, 2)
        model = cls(cfg, profile.gpu, profile.calibration, bytes_per)
        if refit and profile.samples:
            model.calibration = model.fit(profile.samples)
        return model

    # roofline -------------------------------------------------------------------------------------
    def kernel_times_s(self, shape: StepShape, sms: float) -> dict[KernelClass, float]:
        """Each kernel class's roofline time on `sms` SMs (no calibration)."""
        return {k: roofline_time_s(c.flops, c.num_bytes, sms, self.gpu)
                for k, c in kernel_costs(self.cfg, shape, self.dtype_bytes).items()}

    def group_times_s(self, shape: StepShape, sms: float) -> tuple[float, float]:
        """(T_linear, T_attention) on `sms` SMs: the sums of `kernel_times_s` by group, computed from
        per-model coefficients (a prediction must cost microseconds: the policy makes dozens per step)."""
        ceilings = self._ceilings.get(sms)
        if ceilings is None:
            ceilings = self._ceilings[sms] = (self.gpu.compute_flops_per_s(sms), self.gpu.bandwidth_bytes_per_s(sms))
        return self._groups(shape.num_tokens, shape.num_seqs, shape.num_context_tokens, shape.num_attention_pairs,
                            ceilings)

    def _groups(self, t: int, s: int, c: int, pairs: int, ceilings: tuple[float, float]) -> tuple[float, float]:
        compute, bandwidth = ceilings
        lin = 0.0
        for flops_per_row, weight_bytes, bytes_per_row, by_seq in self._coef.linear:
            rows = s if by_seq else t
            lin += max(flops_per_row * rows / compute, (weight_bytes + bytes_per_row * rows) / bandwidth)
        a = self._coef
        att = max(a.attn_flops_per_pair * pairs / compute,
                  (a.attn_bytes_per_context * c + a.attn_bytes_per_token * t) / bandwidth)
        return lin, att

    # predictions ----------------------------------------------------------------------------------
    def predict(self, shape: StepShape, sms: int, other_busy: bool = False, index: int | None = None) -> StepPrediction:
        lin, att = self.group_times_s(shape, sms)
        calibrated = self.calibration.of(shape.phase).time_s(lin, att, other_busy)
        return StepPrediction(shape.phase, calibrated * self.online.factor(shape.phase, index, shape.size),
                              calibrated, sms)

    def predict_prefill_s(self, tokens: int, context: int | None = None, sms: int | None = None,
                          other_busy: bool = False, num_seqs: int = 1, index: int | None = None,
                          num_attention_pairs: int | None = None) -> float:
        """A prefill step of `tokens` new tokens in `num_seqs` prompts whose KV reaches `context` tokens
        (StepShape.prefill's pairs unless given, computed inline: the policy calls this dozens of times per
        step)."""
        n = sms or self.gpu.sm_count
        ceilings = self._ceilings.get(n)
        if ceilings is None:
            ceilings = self._ceilings[n] = (self.gpu.compute_flops_per_s(n), self.gpu.bandwidth_bytes_per_s(n))
        t = max(1, tokens)
        ctx = t if context is None else max(context, t)
        s = max(1, num_seqs)
        per_new, per_ctx = t / s, ctx / s
        pairs = num_attention_pairs if num_attention_pairs is not None else \
            max(t, round(s * (per_new * per_ctx - per_new * (per_new - 1) / 2)))
        lin, att = self._groups(t, s, ctx, pairs, ceilings)
        return self.calibration.prefill.time_s(lin, att, other_busy) * self.online.factor("prefill", index, t)

    def predict_decode_s(self, batch: int, total_context: int, sms: int | None = None, other_busy: bool = False,
                         index: int | None = None) -> float:
        """A decode step of `batch` sequences holding `total_context` KV tokens in all (the hot path of the
        split rule: no StepShape built)."""
        n = sms or self.gpu.sm_count
        ceilings = self._ceilings.get(n)
        if ceilings is None:
            ceilings = self._ceilings[n] = (self.gpu.compute_flops_per_s(n), self.gpu.bandwidth_bytes_per_s(n))
        b = max(1, batch)
        ctx = max(total_context, b)
        lin, att = self._groups(b, b, ctx, ctx, ceilings)
        return self.calibration.decode.time_s(lin, att, other_busy) * self.online.factor("decode", index, b)

    def saturation_tokens(self, sms: int, share: float = SATURATION_SHARE, max_tokens: int = 16384, seq_len: int = 1024,
                          other_busy: bool = False) -> int:
        """Fewest tokens per prefill step whose throughput (tokens / s) reaches `share` of the best
        throughput of any step up to `max_tokens` (sizes 64, 128, ... and max_tokens): past it a bigger batch
        only delays its first requests (arithmetic intensity has saturated). Prompts of `seq_len` tokens.
        Predictions include the online correction, which is kept per size (small corun prefill steps run
        far slower than calibrated, large ones about as calibrated): the best is taken over the sizes
        rather than read at max_tokens, where a size never measured falls back to the phase's factor and
        could look slower than the sizes served."""
        def rate(t: int) -> float:
            return t / self.predict_prefill_s(t, t, sms, other_busy, num_seqs=max(1, math.ceil(t / seq_len)))
        sizes = [t for t in (64 << k for k in range(20)) if t < max_tokens] + [max_tokens]
        rates = [rate(t) for t in sizes]
        best = max(range(len(sizes)), key=rates.__getitem__)
        goal = share * rates[best]
        lo, hi = 1, sizes[best]
        while lo < hi:
            mid = (lo + hi) // 2
            if rate(mid) >= goal:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def crossover_tokens(self, sms: int) -> float:
        """Tokens per step at which the weight GEMMs turn from memory- to compute-bound on `sms` SMs
        (weights dominate the bytes: 2 T h N / compute = b h N / bandwidth => T = b x ridge / 2)."""
        return self.dtype_bytes * self.gpu.ridge_intensity(sms) / 2

    # learning -------------------------------------------------------------------------------------
    def observation(self, sample: Sample) -> Observation:
        lin, att = self.group_times_s(sample.shape, sample.sms)
        return Observation(sample.phase, lin, att, sample.other_busy, sample.measured_s)

    def fit(self, samples: list[Sample], ridge: float = 1e-4, min_alone_shapes: int = 0) -> Calibration:
        """Calibration factors fitted to profiled steps (does not change this model); this model's own factors are
        the prior (the ridge's target; with `min_alone_shapes`, what a phase keeps whose samples ran alone in fewer
        shapes: bullet_ray.perf.calibration.fit.SERVED_MIN_ALONE_SHAPES)."""
        return fit_calibration([self.observation(s) for s in samples], ridge, self.calibration, min_alone_shapes)

    def observe(self, shape: StepShape, sms: int, other_busy: bool, index: int, measured_s: float) -> float:
        """A measured step while serving: feeds the online correction; returns the relative error of the
        prediction made before this step ((predicted - measured) / measured)."""
        pred = self.predict(shape, sms, other_busy, index)
        self.online.observe(shape.phase, index, pred.calibrated_s, measured_s, shape.size)
        return (pred.seconds - measured_s) / measured_s

    def describe(self) -> dict[str, object]:
        return {"gpu": self.gpu.name, "calibration": self.calibration.to_dict(), "online": self.online.describe()}


@dataclass(frozen=True)
class _Coefficients:
    # (FLOPs per row, weight bytes, bytes per row, rows are sequences (lm_head) rather than tokens)
    linear: tuple[tuple[float, float, float, bool], ...]
    attn_flops_per_pair: float
    attn_bytes_per_context: float
    attn_bytes_per_token: float


def _linear_coefficients(cfg: ModelConfig, dtype_bytes: int) -> _Coefficients:
    """kernel_costs' formulas as FLOPs and bytes per row (bullet_ray.perf.kernels has them written out)."""
    one = kernel_costs(cfg, StepShape("prefill", 1, 1, 1, 1), dtype_bytes)
    two = kernel_costs(cfg, StepShape("prefill", 2, 2, 2, 2), dtype_bytes)
    linear = []
    for k in (KernelClass.QKV, KernelClass.O_PROJ, KernelClass.GATE_UP, KernelClass.DOWN, KernelClass.LM_HEAD):
        per_row_bytes = two[k].num_bytes - one[k].num_bytes
        linear.append((one[k].flops, one[k].num_bytes - per_row_bytes, per_row_bytes, k is KernelClass.LM_HEAD))
    attn_one = kernel_costs(cfg, StepShape("prefill", 1, 1, 1, 1), dtype_bytes)[KernelClass.ATTENTION_PREFILL]
    ctx = kernel_costs(cfg, StepShape("prefill", 1, 1, 2, 1), dtype_bytes)[KernelClass.ATTENTION_PREFILL]
    per_context = ctx.num_bytes - attn_one.num_bytes
    return _Coefficients(tuple(linear), attn_one.flops, per_context, attn_one.num_bytes - per_context)


SATURATION_GRID = tuple(range(8, 65, 4))  # SMs
KNEE_GRID = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)  # the H100 sweep's best, 4, lies inside


def refine_bandwidth_curve(cfg: ModelConfig, gpu: GpuSpec, samples: list[Sample],
                           dtype_bytes: int = 2) -> tuple[GpuSpec, Calibration]:
    """The bandwidth curve's shape (saturation_sms, knee) that lets the calibration fit the profiled decode
    steps best, and that calibration. `bullet-ray profile` first fits the curve to a GEMV probe on each
    ladder entry's SMs; on the H100 (2026-11-26) that probe read 1.0-2.0 TB/s where the careful GEMV of
    shared/GPU.md read 1.3-2.6, fitted a curve flat from 10 SMs, and left the decode steps 8.0-9.6% / 21-25%
    off (median / p90, alone / beside a busy prefill) against 5.8-6.1% / 18-21% with this refinement
    (benchmarks/results/lease_m2l/refit_profile.txt). The steps are what the engine predicts, so they
    choose the shape: for each (saturation, knee) of a grid the calibration is refitted on every sample and
    the decode steps' median + p90 relative error is kept lowest (ties keep the probe's curve). Needs decode
    samples on at least two SM counts; otherwise the probe's curve stays."""
    decode = [s for s in samples if s.phase == "decode"]

    def fitted(spec: GpuSpec) -> tuple[float, Calibration]:
        model = PerfModel(cfg, spec, dtype_bytes=dtype_bytes)
        model.calibration = model.fit(samples)
        errs = relative_errors(model, decode)
        return quantile(errs, 0.5) + quantile(errs, 0.9), model.calibration

    best_score, best_cal = fitted(gpu)
    best_gpu = gpu
    if len({s.sms for s in decode}) < 2:
        return best_gpu, best_cal
    for sat in SATURATION_GRID:
        for knee in KNEE_GRID:
            spec = replace(gpu, saturation_sms=float(sat), knee=knee)
            score, cal = fitted(spec)
            if score < best_score - 1e-9:
                best_score, best_gpu, best_cal = score, spec, cal
    return best_gpu, best_cal


def relative_errors(model: PerfModel, samples: list[Sample]) -> list[float]:
    """|predicted - measured| / measured of each sample (no online correction)."""
    out = []
    for s in samples:
        p = model.predict(s.shape, s.sms, s.other_busy).calibrated_s
        out.append(abs(p - s.measured_s) / s.measured_s)
    return out


def profile_fit(model: PerfModel, samples: list[Sample]) -> dict[str, object]:
    """A profile's `fit` record: the sample count and each phase's median and p90 relative error."""
    fit: dict[str, object] = {"num_samples": len(samples)}
    for phase in ("prefill", "decode"):
        errs = relative_errors(model, [s for s in samples if s.phase == phase])
        fit[phase] = {"median_rel_error": round(quantile(errs, 0.5), 4), "p90_rel_error": round(quantile(errs, 0.9), 4)}
    return fit


def errors_by_side(model: PerfModel, samples: list[Sample]) -> dict[str, dict[str, float]]:
    """Median and p90 relative error and count per phase, alone and beside a busy other side
    ("prefill.alone", "prefill.busy", "decode.alone", "decode.busy")."""
    out = {}
    for phase in ("prefill", "decode"):
        for busy in (False, True):
            errs = relative_errors(model, [s for s in samples if s.phase == phase and s.other_busy == busy])
            out[f"{phase}.{'busy' if busy else 'alone'}"] = {"median": round(quantile(errs, 0.5), 4),
                                                             "p90": round(quantile(errs, 0.9), 4), "n": len(errs)}
    return out


def quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)
