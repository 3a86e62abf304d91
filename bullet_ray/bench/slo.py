"""Latency targets (SLOs), SLO attainment, goodput and the latency/throughput summary of a run.

Conventions (DESIGN.md "SLO conventions"): a request meets an SLO when it succeeded, its TTFT is within the
TTFT target and its TPOT within the TPOT target (a one-token output has no TPOT and only has to meet TTFT).
Failed requests are misses. TTFT targets are absolute (`relaxed`, `strict`) or normalized per prompt token
as in Bullet (`bullet-sharegpt` 3.0 ms/token, `bullet-azure-code` and `bullet-arxiv` 1.5 ms/token).
Attainment = share of all sent requests meeting the SLO. Goodput = the highest swept request rate whose
attainment is >= 90% (measured), plus the rate where a straight line between that rate and the next swept
rate crosses 90% (interpolated). Every summary names the SLO it used.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

logger = logging.getLogger(__name__)

GOODPUT_ATTAINMENT = 0.9
PERCENTILES = (50, 90, 99)


class TimedRequest(Protocol):
    """What SLO checks read from a request record (serve_bench.RequestRecord implements it)."""

    @property
    def success(self) -> bool: ...
    @property
    def ttft_s(self) -> float | None: ...
    @property
    def tpot_s(self) -> float | None: ...
    @property
    def prompt_tokens(self) -> int | None: ...


@dataclass(frozen=True)
class SLO:
    """TTFT and TPOT targets. Exactly one of ttft_s / ttft_ms_per_prompt_token is set."""

    name: str
    tpot_s: float
    ttft_s: float | None = None
    ttft_ms_per_prompt_token: float | None = None

    def __post_init__(self) -> None:
        if (self.ttft_s is None) == (self.ttft_ms_per_prompt_token is None):
            raise ValueError(f"SLO {self.name!r}: give exactly one of ttft_s and ttft_ms_per_prompt_token")
        if self.tpot_s <= 0 or (self.ttft_s is not None and self.ttft_s <= 0) or \
                (self.ttft_ms_per_prompt_token is not None and self.ttft_ms_per_prompt_token <= 0):
            raise ValueError(f"SLO {self.name!r}: targets must be > 0")

    def ttft_target_s(self, prompt_tokens: int | None) -> float:
        if self.ttft_s is not None:
            return self.ttft_s
        return self.ttft_ms_per_prompt_token * max(1, prompt_tokens or 1) / 1000.0  # type: ignore[operator]

    def meets(self, record: TimedRequest) -> bool:
        if not record.success or record.ttft_s is None:
            return False
        if record.ttft_s > self.ttft_target_s(record.prompt_tokens):
            return False
        return record.tpot_s is None or record.tpot_s <= self.tpot_s

    def engine_targets(self) -> dict[str, float]:
        """EngineConfig's targets that aim the split policy at this SLO: tpot_target_ms and, for a fixed TTFT,
        ttft_target_ms; for a per-prompt-token TTFT, ttft_target_ms_per_prompt_token and ttft_target_ms (the floor)
        both at its ms per token, so that max(floor, ms per token x prompt tokens) is the target for every prompt."""
        targets = {"tpot_target_ms": self.tpot_s * 1e3}
        if self.ttft_s is not None:
            return {"ttft_target_ms": self.ttft_s * 1e3, **targets}
        per_token = self.ttft_ms_per_prompt_token
        assert per_token is not None  # an SLO sets exactly one of the two
        return {"ttft_target_ms": per_token, "ttft_target_ms_per_prompt_token": per_token, **targets}

    def describe(self) -> str:
        ttft = f"TTFT <= {self.ttft_s * 1000:g} ms" if self.ttft_s is not None else \
            f"TTFT <= {self.ttft_ms_per_prompt_token:g} ms x prompt tokens"
        return f"{self.name}: {ttft}, TPOT <= {self.tpot_s * 1000:g} ms"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "description": self.describe()}


PRESETS: dict[str, SLO] = {
    "relaxed": SLO("relaxed", ttft_s=1.0, tpot_s=0.050),
    "strict": SLO("strict", ttft_s=0.5, tpot_s=0.025),
    "bullet-sharegpt": SLO("bullet-sharegpt", ttft_ms_per_prompt_token=3.0, tpot_s=0.150),
    "bullet-azure-code": SLO("bullet-azure-code", ttft_ms_per_prompt_token=1.5, tpot_s=0.200),
    "bullet-arxiv": SLO("bullet-arxiv", ttft_ms_per_prompt_token=1.5, tpot_s=0.175),
}


def parse_slo(spec: str) -> SLO:
    """A preset name, or custom targets 'ttft_ms=800,tpot_ms=40' / 'ttft_ms_per_token=2,tpot_ms=100'
    (optionally 'name=...')."""
    if spec in PRESETS:
        return PRESETS[spec]
    if "=" not in spec:
        raise ValueError(f"unknown SLO {spec!r}; presets: {', '.join(PRESETS)}; or custom "
                         f"'ttft_ms=800,tpot_ms=40' / 'ttft_ms_per_token=2,tpot_ms=100'")
    fields = dict(part.split("=", 1) for part in spec.split(",") if part)
    known = {"ttft_ms", "ttft_ms_per_token", "tpot_ms", "name"}
    if set(fields) - known or "tpot_ms" not in fields:
        raise ValueError(f"custom SLO {spec!r}: keys are {sorted(known)} and tpot_ms is required")
    return SLO(name=fields.get("name", spec), tpot_s=float(fields["tpot_ms"]) / 1000,
               ttft_s=float(fields["ttft_ms"]) / 1000 if "ttft_ms" in fields else None,
               ttft_ms_per_prompt_token=float(fields["ttft_ms_per_token"]) if "ttft_ms_per_token" in fields
               else None)


def attainment(records: Sequence[TimedRequest], slo: SLO) -> float:
    """Share of all requests (failed ones included, as misses) that meet the SLO; 0 for no requests."""
    if not records:
        return 0.0
    return sum(slo.meets(r) for r in records) / len(records)


@dataclass(frozen=True)
class Goodput:
    slo_name: str
    target_attainment: float
    measured_rps: float  # highest swept rate with attainment >= target; 0 if none
    interpolated_rps: float | None  # where attainment crosses the target between swept rates; None if unknown
    is_bracketed: bool  # a swept rate above measured_rps missed the target (else goodput may be higher)
    points: list[tuple[float, float]]  # (rate, attainment), sorted by rate

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def goodput(points: Iterable[tuple[float, float]], slo_name: str,
            target: float = GOODPUT_ATTAINMENT) -> Goodput:
    """Goodput from (request rate, attainment) points of a rate sweep (infinite rates are ignored)."""
    pts = sorted((float(r), float(a)) for r, a in points if math.isfinite(r) and r > 0)
    meeting = [i for i, (_, a) in enumerate(pts) if a >= target]
    if not meeting:
        return Goodput(slo_name, target, 0.0, None, bool(pts), pts)
    i = meeting[-1]
    rate, att = pts[i]
    if i + 1 == len(pts):
        return Goodput(slo_name, target, rate, rate, False, pts)
    next_rate, next_att = pts[i + 1]
    interpolated = rate + (att - target) / (att - next_att) * (next_rate - rate)
    return Goodput(slo_name, target, rate, interpolated, True, pts)


def _stats_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    if len(values_s) == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def summarize(records: Sequence[Any], duration_s: float, slos: Sequence[SLO]) -> dict[str, Any]:
    """Latency percentiles (ms) over successful requests, throughput over the run, attainment per SLO.

    records need: success, ttft_s, tpot_s, e2e_s, itl_s (list), prompt_tokens, output_tokens,
    output_tokens_requested.
    """
    done = [r for r in records if r.success]
    num_output = sum(r.output_tokens or 0 for r in done)
    num_prompt = sum(r.prompt_tokens or 0 for r in done)
    per_sec = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    summary: dict[str, Any] = {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_failed": len(records) - len(done),
        "num_output_length_mismatch": sum(1 for r in done if r.output_tokens != r.output_tokens_requested),
        "duration_s": duration_s,
        "total_prompt_tokens": num_prompt,
        "total_output_tokens": num_output,
        "request_throughput_rps": per_sec(len(done)),
        "output_throughput_tps": per_sec(num_output),
        "total_token_throughput_tps": per_sec(num_output + num_prompt),
        "ttft_ms": _stats_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "ttft_ms_per_prompt_token": _stats_ms([r.ttft_s / r.prompt_tokens for r in done
                                               if r.ttft_s is not None and r.prompt_tokens]),
        "tpot_ms": _stats_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": _stats_ms([gap for r in done for gap in r.itl_s]),
        "e2e_ms": _stats_ms([r.e2e_s for r in done if r.e2e_s is not None]),
        "slo": {},
    }
    for slo in slos:
        met = sum(slo.meets(r) for r in records)
        summary["slo"][slo.name] = {**slo.to_dict(), "attainment": met / len(records) if records else 0.0,
                                    "num_met": met, "good_request_throughput_rps": per_sec(met)}
    return summary
