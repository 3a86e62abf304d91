"""Least-squares fit of the calibration factors from profiled steps.

Each profiled step gives its roofline times (T_linear, T_attention on the SMs it ran on), whether the
other side was busy, and its measured time y. Per phase, from the steps run alone:

    minimize  sum_k ((y_k - (overhead + linear T_lin,k + attention T_attn,k)) / y_k)^2
              + ridge x sum_j (scale_j (theta_j - prior_j))^2

relative residuals (the model's accuracy target is relative), and a small ridge toward the prior
(overhead 0, efficiencies 1) so that columns the sweep cannot tell apart (e.g. decode's overhead and its
weight reads on saturated SMs) stay finite and sensible instead of trading off wildly. Factors are kept
inside bounds (a negative overhead is refitted at 0). Then, from the steps run with the other side busy:

    corun_slowdown = sum_k p_k (y_k - p_k) / y_k^2 / sum_k p_k^2 / y_k^2      (p_k: the alone prediction)

clamped to [0, 2]. Pure Python (a 3 x 3 linear solve).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bullet_ray.perf.calibration.factors import Calibration, PhaseCalibration
from bullet_ray.perf.kernels import PHASES, Phase

FACTOR_BOUNDS = (0.05, 50.0)  # inverse efficiencies outside this are a broken profile, not a slow kernel
# what `refit_from_steps` asks of a served log (`min_alone_shapes`): a phase whose steps ran alone in fewer
# distinct shapes (roofline GEMM and attention times) keeps the prior's base factors and fits the co-run slowdown
# only. A serving log runs prefill alone mostly for each rate's first requests (4 shapes in the H200 and H100 runs),
# from which the three base factors ran to a corner (GEMMs 3.9-17x, attention at its floor). Off (0) for profile
# sweeps, whose few shapes are clean (the seed profile has 3 prefill shapes, `--quick` 2-3)
SERVED_MIN_ALONE_SHAPES = 6
MAX_CORUN_SLOWDOWN = 2.0


@dataclass(frozen=True)
class Observation:
    """One profiled (or served) step, reduced to what the fit needs."""

    phase: Phase
    linear_s: float  # roofline time of the weight GEMMs on the SMs the step ran on
    attention_s: float  # roofline time of attention on those SMs
    other_busy: bool  # the other side ran at the same time
    measured_s: float  # the step's wall time


def solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b (Gaussian elimination, partial pivoting); ValueError when a is singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            raise ValueError("singular system")
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for k in range(col, n + 1):
                m[r][k] -= f * m[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


def _ridge(rows: Sequence[Sequence[float]], ys: Sequence[float], prior: Sequence[float], free: Sequence[int],
           ridge: float) -> list[float]:
    """Weighted (1 / y) ridge least squares over the `free` columns; the others stay at the prior."""
    theta = list(prior)
    xs = [[r[j] / y for j in free] for r, y in zip(rows, ys)]
    rhs = [1.0 - sum(r[j] * theta[j] for j in range(len(theta)) if j not in free) / y for r, y in zip(rows, ys)]
    k = len(free)
    scales = [math.sqrt(sum(x[j] ** 2 for x in xs) / len(xs)) or 1.0 for j in range(k)]
    ata = [[sum(x[p] * x[q] for x in xs) for q in range(k)] for p in range(k)]
    atb = [sum(x[p] * t for x, t in zip(xs, rhs)) for p in range(k)]
    lam = ridge * len(xs)
    for p in range(k):
        ata[p][p] += lam * scales[p] ** 2
        atb[p] += lam * scales[p] ** 2 * prior[free[p]]
    for j, value in zip(free, solve(ata, atb)):
        theta[j] = value
    return theta


def fit_phase(observations: Iterable[Observation], ridge: float = 1e-4,
              prior: PhaseCalibration | None = None, min_alone_shapes: int = 0) -> PhaseCalibration:
    """The factors of one phase from its observations (the prior where there are none)."""
    prior = prior or PhaseCalibration()
    obs = [o for o in observations if o.measured_s > 0]
    alone = [o for o in obs if not o.other_busy] or obs
    theta0 = [prior.overhead_s, prior.linear, prior.attention]
    theta = theta0
    if num_shapes(alone) < min_alone_shapes:
        alone = []  # too few shapes to tell overhead, GEMMs and attention apart: keep the prior's, fit the co-run
    if alone:
        rows = [(1.0, o.linear_s, o.attention_s) for o in alone]
        ys = [o.measured_s for o in alone]
        free = [j for j in range(3) if any(r[j] > 0 for r in rows)]
        theta = _ridge(rows, ys, theta0, free, ridge)
        if theta[0] < 0:
            theta = _ridge(rows, ys, [0.0, *theta0[1:]], [j for j in free if j != 0], ridge)
        lo, hi = FACTOR_BOUNDS
        theta = [max(0.0, theta[0]), min(hi, max(lo, theta[1])), min(hi, max(lo, theta[2]))]
    fitted = PhaseCalibration(theta[0], theta[1], theta[2], 0.0)
    busy = [o for o in obs if o.other_busy]
    corun = prior.corun_slowdown
    if busy and len(alone) < len(obs):
        num = den = 0.0
        for o in busy:
            p = fitted.time_s(o.linear_s, o.attention_s, other_busy=False)
            num += p * (o.measured_s - p) / o.measured_s ** 2
            den += p * p / o.measured_s ** 2
        corun = min(MAX_CORUN_SLOWDOWN, max(0.0, num / den)) if den > 0 else corun
    return PhaseCalibration(fitted.overhead_s, fitted.linear, fitted.attention, corun)


def num_shapes(observations: Iterable[Observation]) -> int:
    """Distinct step shapes among `observations` (their roofline GEMM and attention times)."""
    return len({(round(o.linear_s, 9), round(o.attention_s, 9)) for o in observations})


def fit_calibration(observations: Iterable[Observation], ridge: float = 1e-4,
                    prior: Calibration | None = None, min_alone_shapes: int = 0) -> Calibration:
    """Both phases' factors; a phase without observations keeps the prior's, and one whose observations ran alone
    in fewer than `min_alone_shapes` shapes keeps the prior's base factors (fit_phase)."""
    obs = list(observations)
    prior = prior or Calibration()
    fitted = {phase: fit_phase([o for o in obs if o.phase == phase], ridge, prior.of(phase), min_alone_shapes)
              if any(o.phase == phase for o in obs) else prior.of(phase) for phase in PHASES}
    return Calibration(**fitted)
