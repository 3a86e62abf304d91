"""Step-time fits for benchmarks.replay_split: least squares per (side, SMs, other side busy) over a step log, and
the simulated 'real' step time (fitted x lognormal noise, or x the log's own residuals: noise.py; entries without their own fit scaled by the roofline)."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from typing import Any

from benchmarks.refit_from_steps import sample_of
from benchmarks.replay_order import sigma_for_p90_error
from bullet_ray.perf.kernels import StepShape
from bullet_ray.perf.model import PerfModel

MIN_FIT_STEPS = 20  # steps a (SMs, other busy) entry needs for its own least-squares fit
MAX_FIT_ERROR = 0.2  # an entry whose own fit misses its median step by more takes a neighbour's, scaled
TRIM_SHARE, TRIM_ROUNDS = 0.1, 2  # the fit leaves out its worst-fitted 10% of steps, twice


@dataclass(frozen=True)
class LinearFit:
    coef: tuple[float, float, float]  # fixed s, then per feature (prefill: token, pair; decode: sequence, context)
    num_steps: int
    median_error: float  # of |fit - measured| / measured over its steps
    p90_error: float


def features(shape: StepShape) -> tuple[float, float, float]:
    if shape.phase == "prefill":
        return 1.0, float(shape.num_tokens), float(shape.num_attention_pairs)
    return 1.0, float(shape.num_seqs), float(shape.num_context_tokens)


def entry_of(r: dict) -> tuple[str, int, bool]:
    """A logged prefill or decode step's (phase, SMs of its side, other side busy): the key of its fit."""
    s = sample_of(r)
    return s.phase, s.sms, s.other_busy


def fit_linear(rows: list[dict]) -> LinearFit:
    """Least squares measured = c0 + c1 x1 + c2 x2 (features of the step's shape, `refit_from_steps.sample_of`), coefficients kept >= 0; the
    TRIM_SHARE of steps worst fitted are left out, TRIM_ROUNDS times, before the last fit."""
    import numpy as np

    x = np.array([features(sample_of(r).shape) for r in rows])
    y = np.array([r["measured_ms"] / 1e3 for r in rows])
    keep = np.ones(len(y), dtype=bool)
    for _ in range(TRIM_ROUNDS):  # refit without the steps the fit before misses by most (warm-up, stalls)
        coef = np.clip(np.linalg.lstsq(x[keep], y[keep], rcond=None)[0], 0.0, None)
        err = np.abs(x @ coef - y) / y
        keep = err <= np.quantile(err, 1 - TRIM_SHARE)
    coef = np.clip(np.linalg.lstsq(x[keep], y[keep], rcond=None)[0], 0.0, None)
    err = np.abs(x @ coef - y) / y  # over every step, the trimmed ones too
    return LinearFit((float(coef[0]), float(coef[1]), float(coef[2])), len(rows), float(np.median(err)),
                     float(np.quantile(err, 0.9)))


@dataclass
class StepModel:
    """The simulated 'real' step time: the log's fits per (phase, SMs, other busy), scaled for the others."""
    fits: dict[tuple[str, int, bool], LinearFit]
    roofline: PerfModel  # the profile without online correction: the scaling between entries
    sigma: dict[str, float]  # lognormal noise per phase
    p90_log_error: dict[str, float]  # the step log's p90 |predicted - measured| / measured per phase
    # noise.ResidualNoise: draw measured / fitted from the log's own steps instead of the lognormal (None: lognormal)
    residuals: Any = None
    # a what-if: every prefill step this many times faster than the log's (1: as logged); e.g. the partition's
    # GEMMs sized for its SMs (docs/policy.md, twenty-seventh section)
    prefill_speedup: float = 1.0

    def seconds(self, shape: StepShape, sms: int, other_busy: bool) -> float:
        key: tuple[str, int, bool] = (shape.phase, sms, other_busy)
        fit = self.fits.get(key)
        if fit is None:
            near = [k for k in self.fits if k[0] == shape.phase]
            key = min(near, key=lambda k: (k[2] != other_busy, abs(k[1] - sms)))
            fit = self.fits[key]
        t = sum(c * f for c, f in zip(fit.coef, features(shape)))
        if key[1:] != (sms, other_busy):
            t *= self.roofline.predict(shape, sms, other_busy).calibrated_s / \
                self.roofline.predict(shape, key[1], key[2]).calibrated_s
        if shape.phase == "prefill":
            t /= self.prefill_speedup
        return max(t, 1e-4)

    def noisy_seconds(self, shape: StepShape, sms: int, other_busy: bool, rng: random.Random | None) -> float:
        t = self.seconds(shape, sms, other_busy)
        if self.residuals is not None:
            return t * self.residuals.ratio(shape.phase, sms, other_busy, rng) if rng is not None else t
        sigma = self.sigma[shape.phase]
        return t * math.exp(rng.gauss(0.0, sigma)) if rng is not None and sigma > 0 else t


def fit_step_model(log_records: list[dict], roofline: PerfModel) -> StepModel:
    """Fits per (phase, SMs, other busy) over the log's steps (not across a switch, not mixed; entries with
    MIN_FIT_STEPS steps whose fit's median error is at most MAX_FIT_ERROR); raises
    ValueError when a phase has no entry with MIN_FIT_STEPS steps."""
    groups: dict[tuple[str, int, bool], list[dict]] = {}
    errors: dict[str, list[float]] = {"prefill": [], "decode": []}
    for r in log_records:
        if r.get("kind") != "step" or r.get("phase") not in ("prefill", "decode") or not r.get("measured_ms", 0) > 0:
            continue
        errors[r["phase"]].append(abs(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"])
        if r.get("across_switch"):
            continue
        groups.setdefault(entry_of(r), []).append(r)
    fits = {k: fit_linear(rows) for k, rows in groups.items() if len(rows) >= MIN_FIT_STEPS}
    fits = {k: fit for k, fit in fits.items() if fit.median_error <= MAX_FIT_ERROR}  # else scaled from a neighbour
    for phase in ("prefill", "decode"):
        if not any(k[0] == phase for k in fits):
            raise ValueError(f"the step log has no {phase} entry with >= {MIN_FIT_STEPS} steps to fit")
    p90 = {p: statistics.quantiles(e, n=10)[-1] if len(e) > 1 else 0.0 for p, e in errors.items()}
    return StepModel(fits, roofline, {p: sigma_for_p90_error(v) for p, v in p90.items()}, p90)
