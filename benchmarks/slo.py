"""SLO attainment and goodput (DistServe's definitions), with the presets of DESIGN.md.

A request meets its SLO when TTFT <= the TTFT target and TPOT <= the TPOT target; failed requests miss.
TTFT targets are absolute (presets `relaxed`: 1 s / 50 ms, `strict`: 0.5 s / 25 ms) or per prompt token
(Bullet's convention, e.g. ShareGPT 3.0 ms/token with TPOT 150 ms). Goodput = the highest request rate
whose attainment is >= 90%.
"""

from __future__ import annotations

from dataclasses import dataclass

PRESETS = {"relaxed": (1.0, None, 0.050), "strict": (0.5, None, 0.025),
           "sharegpt": (None, 0.0030, 0.150), "azure-code": (None, 0.0015, 0.200), "arxiv": (None, 0.0015, 0.175)}


@dataclass(frozen=True)
class Slo:
    name: str
    ttft_s: float | None  # absolute TTFT target
    ttft_s_per_prompt_token: float | None  # or normalized per prompt token
    tpot_s: float

    @classmethod
    def preset(cls, name: str) -> Slo:
        if name not in PRESETS:
            raise ValueError(f"unknown SLO preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(name, *PRESETS[name])

    def ttft_target(self, prompt_tokens: int) -> float:
        if self.ttft_s is not None:
            return self.ttft_s
        assert self.ttft_s_per_prompt_token is not None
        return self.ttft_s_per_prompt_token * prompt_tokens

    def meets(self, record: dict) -> bool:
        if not record.get("ok"):
            return False
        tpot = record.get("tpot_s") or 0.0
        return record["ttft_s"] <= self.ttft_target(record["prompt_tokens"]) and tpot <= self.tpot_s


def attainment(records: list[dict], slo: Slo) -> float:
    return sum(slo.meets(r) for r in records) / len(records) if records else 0.0


def goodput(rate_to_attainment: dict[float, float], threshold: float = 0.9) -> float:
    """The highest swept rate with attainment >= threshold (0 if none)."""
    good = [rate for rate, att in rate_to_attainment.items() if att >= threshold]
    return max(good) if good else 0.0
