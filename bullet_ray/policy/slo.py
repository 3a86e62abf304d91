"""Latency targets the policy schedules for (DESIGN.md's SLO conventions)."""

from __future__ import annotations

from dataclasses import dataclass

from bullet_ray.errors import ConfigError


@dataclass(frozen=True)
class SloTargets:
    ttft_s: float = 0.5  # time to first token (the strict preset: 0.5 s; relaxed: 1 s)
    tpot_s: float = 0.025  # time per output token after the first (strict 25 ms; relaxed 50 ms)
    # Bullet's per-prompt-token TTFT (ShareGPT 3 ms, Azure code 1.5 ms; EngineConfig's
    # ttft_target_ms_per_prompt_token): when set, a request's TTFT target is max(ttft_s, ttft_per_token_s x prompt
    # tokens), ttft_s its floor
    ttft_per_token_s: float | None = None

    def __post_init__(self) -> None:
        if not self.ttft_s > 0:
            raise ConfigError("ttft_target_ms", f"must be > 0, got {self.ttft_s * 1e3:g}")
        if not self.tpot_s > 0:
            raise ConfigError("tpot_target_ms", f"must be > 0, got {self.tpot_s * 1e3:g}")
        if self.ttft_per_token_s is not None and not self.ttft_per_token_s > 0:
            raise ConfigError("ttft_target_ms_per_prompt_token",
                              f"must be > 0 or null, got {self.ttft_per_token_s * 1e3:g}")

    def ttft_target_s(self, num_prompt_tokens: int) -> float:
        if self.ttft_per_token_s is None:
            return self.ttft_s
        return max(self.ttft_s, self.ttft_per_token_s * num_prompt_tokens)
