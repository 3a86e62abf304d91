"""Predicted time to first token of a request arriving now, from the prefill side's measured steps.

The prefill side (or the hybrid worker of the chunked schedule) publishes every step's token count and
wall time in the shared state block. `PrefillTimeModel` fits step_time = a + b * tokens by least squares
over the last `window` steps it saw (a: the fixed cost of a step, b: the cost per token) and predicts the
TTFT of a new request as the time to prefill everything queued before it plus its own prompt, in steps of
at most `budget` tokens. Before it has seen two different step sizes it uses the mean time per token.
"""

from __future__ import annotations

import math
from collections import deque


class PrefillTimeModel:
    def __init__(self, budget: int, window: int = 64) -> None:
        self.budget = max(1, budget)
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._last_step = -1
        self._prompt_tokens_ema: float | None = None

    def observe_step(self, step: int, num_tokens: int, step_time_s: float) -> None:
        """A step the side published (`step` is its counter; a repeated counter is ignored)."""
        if step == self._last_step or num_tokens <= 0 or step_time_s <= 0:
            return
        self._last_step = step
        self._samples.append((num_tokens, step_time_s))

    def observe_prompt(self, num_tokens: int, weight: float = 0.1) -> None:
        """A submitted prompt's length (an exponential average stands in for the next request's)."""
        ema = self._prompt_tokens_ema
        self._prompt_tokens_ema = float(num_tokens) if ema is None else ema + weight * (num_tokens - ema)

    def coefficients(self) -> tuple[float, float] | None:
        """(seconds per step, seconds per token), or None before any step was seen."""
        if not self._samples:
            return None
        n = len(self._samples)
        mean_x = sum(x for x, _ in self._samples) / n
        mean_y = sum(y for _, y in self._samples) / n
        var = sum((x - mean_x) ** 2 for x, _ in self._samples)
        if var > 0:
            slope = sum((x - mean_x) * (y - mean_y) for x, y in self._samples) / var
            intercept = mean_y - slope * mean_x
            if slope > 0 and intercept >= 0:
                return intercept, slope
        return 0.0, mean_y / mean_x  # one step size so far (or a fit with no meaning): time per token

    def seconds_per_token(self) -> float | None:
        """How much longer `predict_ttft` gets per prompt token more (a full step's share of the per-step time
        included); None before any step was seen."""
        coef = self.coefficients()
        return None if coef is None else coef[1] + coef[0] / self.budget

    def typical_prompt_tokens(self) -> int:
        """The prompt length `predict_ttft` assumes by default (the average prompt so far, at least 1)."""
        return max(1, round(self._prompt_tokens_ema or 1))

    def predict_ttft(self, queued_tokens: int, new_tokens: int | None = None) -> float | None:
        """Seconds until a request of `new_tokens` (default: the average prompt) arriving now gets its first
        token, with `queued_tokens` of earlier prompts still to prefill; None before any step was seen."""
        coef = self.coefficients()
        if coef is None:
            return None
        per_step, per_token = coef
        if new_tokens is None:
            new_tokens = self.typical_prompt_tokens()
        total = max(0, queued_tokens) + max(1, new_tokens)
        return math.ceil(total / self.budget) * per_step + total * per_token
