"""Admission control of one engine replica: when to answer 429 instead of queueing a new request.

An engine refuses a request when its queue (requests without a first token) is full, when the
engine's predicted TTFT of a request arriving now exceeds the TTFT target by more than the margin (with Bullet's
per-prompt-token targets, `admission_ttft_ms_per_prompt_token`, the prediction and the target of THIS request:
the engine's prediction for a typical prompt moved by its per-token part to this prompt's length, against
max(admission_ttft_s, that x its prompt tokens), so a long prompt is not refused for a wait its own target allows
and a short one not for a long prompt's prefill), or when
its decoding side's recent wall time per step (the TPOT its running requests get now) exceeds the TPOT target by
more than the margin. Without the TPOT bound, a TTFT bound alone admitted 1.6x the sustainable rate on the
H100 (benchmarks/results/overload_h100.json: prompts were prefilled in time, then every admitted request
decoded at ~50 ms per token in an ever larger batch).
The router sends each request to the replica with the best predicted TTFT / load, so a refusal means
the best engine was saturated. Pure Python, unit-tested without Ray.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from bullet_ray.engine.outputs import EngineStats
from bullet_ray.errors import ConfigError

# a prompt length past any context, where `length_decides` reads which way a long prompt's answer goes
_PROBE_FAR_TOKENS = 1 << 24


@dataclass(frozen=True)
class AdmissionSettings:
    """Runtime-tunable admission knobs (see BulletAppConfig for each field's meaning)."""

    max_waiting_per_engine: int
    admission_ttft_s: float | None = None
    admission_margin: float = 0.0
    retry_after_s: int = 1
    admission_tpot_s: float | None = None
    admission_ttft_ms_per_prompt_token: float | None = None

    def __post_init__(self) -> None:
        if self.max_waiting_per_engine < 1:
            raise ConfigError("max_waiting_per_engine", f"must be >= 1, got {self.max_waiting_per_engine}")
        if self.admission_ttft_s is not None and self.admission_ttft_s <= 0:
            raise ConfigError("admission_ttft_s", f"must be > 0 or null, got {self.admission_ttft_s}")
        if self.admission_tpot_s is not None and self.admission_tpot_s <= 0:
            raise ConfigError("admission_tpot_s", f"must be > 0 or null, got {self.admission_tpot_s}")
        per_token = self.admission_ttft_ms_per_prompt_token
        if per_token is not None and not per_token > 0:
            raise ConfigError("admission_ttft_ms_per_prompt_token", f"must be > 0 or null, got {per_token}")
        if self.admission_margin < 0:
            raise ConfigError("admission_margin", f"must be >= 0, got {self.admission_margin}")
        if self.retry_after_s < 1:
            raise ConfigError("retry_after_s", f"must be >= 1, got {self.retry_after_s}")

    def updated(self, user_config: dict[str, Any]) -> AdmissionSettings:
        """These settings with the user_config's keys applied; unknown keys raise ConfigError."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(user_config) - known)
        if unknown:
            raise ConfigError(unknown[0], f"not a runtime-tunable setting; known: {sorted(known)}")
        return dataclasses.replace(self, **user_config)

    @property
    def needs_prompt_tokens(self) -> bool:
        """Whether `refusal` may want the request's prompt length (a per-prompt-token TTFT bound is set)."""
        return self.admission_ttft_ms_per_prompt_token is not None

    def length_decides(self, stats: EngineStats) -> bool:
        """Whether the request's prompt length can change `refusal`'s answer now: a per-token bound is set, no
        other check refuses already (queue, TPOT), and some prompt lengths would be refused and others not.
        Tokenizing is then worth it; otherwise it is skipped. The prediction grows linearly with the length
        and the bound is max(fixed, per-token x length): their difference is concave in the length, so the
        lengths refused form one interval and its ends show at 1, on either side of the bound's kink, or far
        out (`_PROBE_FAR_TOKENS`)."""
        if not self.needs_prompt_tokens or stats.predicted_ttft_s is None or self._other_refusal(stats) is not None:
            return False
        per_token_s = self.admission_ttft_ms_per_prompt_token / 1e3  # type: ignore[operator]
        probes = [1, _PROBE_FAR_TOKENS]
        if self.admission_ttft_s is not None:
            kink = self.admission_ttft_s / per_token_s
            probes += [max(1, math.floor(kink)), max(1, math.ceil(kink))]
        answers = {self._ttft_over_bound(stats, n) is None for n in probes}
        return len(answers) > 1

    def refusal_uncounted(self, stats: EngineStats) -> str | None:
        """`refusal` for a request whose prompt was not counted because `length_decides` said its length cannot
        change the answer: with a per-token bound every length then gets the same answer, so a one-token
        prompt's is theirs (the typical prompt's prediction against the fixed bound alone could refuse what
        every length's own bound admits, or admit what every one refuses); without one, the typical prompt's."""
        return self.refusal(stats, 1 if self.needs_prompt_tokens else None)

    def ttft_bound_s(self, num_prompt_tokens: int | None = None) -> float | None:
        """The TTFT a request of `num_prompt_tokens` may be predicted before it is refused (margin included):
        max(admission_ttft_s, admission_ttft_ms_per_prompt_token x its prompt tokens); None: no TTFT bound (none
        set, or only a per-token one and the length unknown)."""
        targets = [] if self.admission_ttft_s is None else [self.admission_ttft_s]
        if self.admission_ttft_ms_per_prompt_token is not None and num_prompt_tokens is not None:
            targets.append(self.admission_ttft_ms_per_prompt_token / 1e3 * num_prompt_tokens)
        return max(targets) * (1.0 + self.admission_margin) if targets else None

    def refusal(self, stats: EngineStats, num_prompt_tokens: int | None = None) -> str | None:
        """Why a request (of `num_prompt_tokens`, where known) arriving now must be refused, or None to admit it.
        With the length known, the engine's prediction for it (`EngineStats.predicted_ttft_for`) meets its bound;
        without it, the prediction for a typical prompt meets the fixed bound."""
        over = self._ttft_over_bound(stats, num_prompt_tokens)
        if stats.num_waiting < self.max_waiting_per_engine and over is not None:
            return f"predicted TTFT {over[0]:.3f} s over the bound {over[1]:.3f} s"
        return self._other_refusal(stats)

    def _ttft_over_bound(self, stats: EngineStats, num_prompt_tokens: int | None) -> tuple[float, float] | None:
        """(predicted TTFT, bound) of a request of `num_prompt_tokens` when the prediction is over the bound."""
        bound_s, predicted = self.ttft_bound_s(num_prompt_tokens), stats.predicted_ttft_for(num_prompt_tokens)
        return (predicted, bound_s) if bound_s is not None and predicted is not None and predicted > bound_s else None

    def _other_refusal(self, stats: EngineStats) -> str | None:
        """The checks that need no prompt length: the queue, the decode step time."""
        if stats.num_waiting >= self.max_waiting_per_engine:
            return f"{stats.num_waiting} requests waiting, limit {self.max_waiting_per_engine}"
        if self.admission_tpot_s is not None and stats.recent_decode_step_s is not None:
            bound_s = self.admission_tpot_s * (1.0 + self.admission_margin)
            if stats.recent_decode_step_s > bound_s:
                return f"decode steps take {stats.recent_decode_step_s * 1e3:.1f} ms, over the TPOT bound " \
                       f"{bound_s * 1e3:.1f} ms"
        return None
