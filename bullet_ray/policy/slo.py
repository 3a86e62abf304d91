"""Latency targets the policy schedules for (DESIGN.md's SLO conventions)."""

from __future__ import annotations

from dataclasses import dataclass

from bullet_ray.errors import ConfigError

# a planning margin never shortens a TTFT target below this share of it (a pushed target shorter than the
# margin): a planned target must stay > 0
MIN_PLANNED_TTFT_SHARE = 0.1


@dataclass(frozen=True)
class SloTargets:
    ttft_s: float = 0.5  # time to first token (the strict preset: 0.5 s; relaxed: 1 s)
    tpot_s: float = 0.025  # time per output token after the first (strict 25 ms; relaxed 50 ms)
    # Bullet's per-prompt-token TTFT (ShareGPT 3 ms, Azure code 1.5 ms; EngineConfig's
    # ttft_target_ms_per_prompt_token): when set, a request's TTFT target is max(ttft_s, ttft_per_token_s x prompt
    # tokens), ttft_s its floor
    ttft_per_token_s: float | None = None
    # planning margin (EngineConfig.ttft_margin_ms): `ttft_target_s` is this much shorter, never below
    # MIN_PLANNED_TTFT_SHARE of the target. Only the policy's targets carry one (EngineConfig.planning_targets);
    # the SLO metrics judge against the real targets (margin 0)
    margin_s: float = 0.0
    # a second, later TTFT target (EngineConfig.ttft_fallback_ms; None: off) for a request that can no longer make
    # its own: the prefill queue's order still serves it by this one, in the slack the others leave
    # (ordering.least_slack_order), instead of after everyone. The planning margin shortens it too
    fallback_ttft_s: float | None = None

    def __post_init__(self) -> None:
        if not self.ttft_s > 0:
            raise ConfigError("ttft_target_ms", f"must be > 0, got {self.ttft_s * 1e3:g}")
        if not self.tpot_s > 0:
            raise ConfigError("tpot_target_ms", f"must be > 0, got {self.tpot_s * 1e3:g}")
        if self.ttft_per_token_s is not None and not self.ttft_per_token_s > 0:
            raise ConfigError("ttft_target_ms_per_prompt_token",
                              f"must be > 0 or null, got {self.ttft_per_token_s * 1e3:g}")
        if not self.margin_s >= 0:
            raise ConfigError("ttft_margin_ms", f"must be >= 0, got {self.margin_s * 1e3:g}")
        if self.fallback_ttft_s is not None and not self.fallback_ttft_s > self.ttft_s:
            raise ConfigError("ttft_fallback_ms", f"must be > ttft_target_ms ({self.ttft_s * 1e3:g}) or null, "
                                                  f"got {self.fallback_ttft_s * 1e3:g}")

    def ttft_target_s(self, num_prompt_tokens: int) -> float:
        target = self.ttft_s
        if self.ttft_per_token_s is not None:
            target = max(target, self.ttft_per_token_s * num_prompt_tokens)
        return self._planned(target)

    def fallback_target_s(self, num_prompt_tokens: int) -> float | None:
        """The fallback TTFT target (None: off), planned with the margin like `ttft_target_s`, never before it."""
        if self.fallback_ttft_s is None:
            return None
        return max(self._planned(self.fallback_ttft_s), self.ttft_target_s(num_prompt_tokens))

    def _planned(self, target: float) -> float:
        """`target` shortened by the planning margin, never below MIN_PLANNED_TTFT_SHARE of it."""
        return max(target - self.margin_s, MIN_PLANNED_TTFT_SHARE * target) if self.margin_s else target
