"""Load forecasting for the cluster controller: Holt's double exponential smoothing (level + trend).

DOPD (arXiv 2511.20982) sizes capacity from a forecast of the arrival rate and of the prompt/output length
mix instead of the load already queued. Here each series (arrival rate, mean prompt tokens, mean output
tokens) is one `Holt` smoother, updated once per controller interval (the lengths without a trend: simple
exponential smoothing, see `LoadForecaster`):

    level_t = alpha * y_t + (1 - alpha) * (level_{t-1} + phi * trend_{t-1})
    trend_t = beta * (level_t - level_{t-1}) + (1 - beta) * phi * trend_{t-1}
    forecast(h) = level_t + (phi + phi^2 + ... + phi^h) * trend_t

No seasonality: the controller looks minutes ahead, where the trend matters and the daily cycle does
not. `phi` < 1 damps the trend so a long horizon does not run away. A ramp is predicted ahead (the
forecast leads the measurement by the horizon), a step converges to the new level. Pure Python; the
state is a plain dict so the controller can persist it (`to_dict` / `from_dict`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bullet_ray.errors import ConfigError


class Holt:
    """One series' smoother. Forecasts are clipped at 0 (rates and lengths are never negative). Without a trend
    (`has_trend` False) it is simple exponential smoothing: level_t = alpha * y_t + (1 - alpha) * level_{t-1}."""

    def __init__(self, alpha: float = 0.5, beta: float = 0.3, phi: float = 0.98, has_trend: bool = True) -> None:
        for name, value in (("alpha", alpha), ("beta", beta), ("phi", phi)):
            if not 0 < value <= 1:
                raise ConfigError(f"forecast_{name}", f"must be in (0, 1], got {value}")
        self.alpha, self.beta, self.phi = alpha, beta, phi
        self.has_trend = has_trend
        self.level: float | None = None
        self.trend = 0.0
        self.num_observations = 0

    def update(self, value: float) -> None:
        """Add the newest observation (one per interval)."""
        if not math.isfinite(value) or value < 0:  # NaN, infinite or negative: a broken reading, skip it
            return
        self.num_observations += 1
        if self.level is None:
            self.level = value
            return
        if not self.has_trend:
            self.level = self.alpha * value + (1 - self.alpha) * self.level
            return
        if self.num_observations == 2:  # the first difference seeds the trend
            self.trend = value - self.level
            self.level = value
            return
        prev = self.level
        self.level = self.alpha * value + (1 - self.alpha) * (prev + self.phi * self.trend)
        self.trend = self.beta * (self.level - prev) + (1 - self.beta) * self.phi * self.trend

    def forecast(self, steps: float) -> float | None:
        """The value `steps` intervals ahead (fractions allowed); None before any observation."""
        if self.level is None:
            return None
        if steps <= 0:
            return max(0.0, self.level)
        if self.phi == 1.0:
            gain = steps
        else:  # phi + phi^2 + ... + phi^steps, continued to fractional steps
            gain = self.phi * (1 - self.phi ** steps) / (1 - self.phi)
        return max(0.0, self.level + gain * self.trend)

    def to_dict(self) -> dict[str, float | int | None]:
        return {"alpha": self.alpha, "beta": self.beta, "phi": self.phi, "level": self.level, "trend": self.trend,
                "num_observations": self.num_observations}

    @classmethod
    def from_dict(cls, state: dict[str, float | int | None]) -> Holt:
        h = cls(float(state["alpha"] or 0.5), float(state["beta"] or 0.3), float(state["phi"] or 0.98))
        h.level = None if state.get("level") is None else float(state["level"])  # type: ignore[arg-type]
        h.trend = float(state.get("trend") or 0.0)
        h.num_observations = int(state.get("num_observations") or 0)
        return h


@dataclass(frozen=True)
class LoadSample:
    """What was measured over the last interval."""

    rate_rps: float  # requests arriving per second (admitted or not)
    # of requests that got a first token / that finished; None when none did, or when the token counter lagged
    # (a mean below one token: control.readings)
    mean_prompt_tokens: float | None
    mean_output_tokens: float | None


@dataclass(frozen=True)
class LoadForecast:
    """The load expected `horizon_s` ahead."""

    horizon_s: float
    rate_rps: float
    mean_prompt_tokens: float
    mean_output_tokens: float

    @property
    def tokens_per_s(self) -> float:
        """Prompt + output tokens per second the engines must process."""
        return self.rate_rps * (self.mean_prompt_tokens + self.mean_output_tokens)


class LoadForecaster:
    """Arrival rate and length mix, each through its own `Holt` smoother. The rate is forecast with its trend over the
    horizon; the mean lengths by simple exponential smoothing, without a trend. A length's per-interval mean is noisy
    (the output-token counter is exported apart from the request counter, so an interval can count requests whose
    tokens come in the next one), and a trend on it misleads twice: carried over a horizon of ten intervals it ran a
    steady 8-token mean down to 0 in the integration test's rising load, and even unused in the forecast it drags the
    level (a first reading of 11 then 8, 8, 8 seeded a trend of -3 that held the level near 5.7 for four
    intervals), hiding the very demand the forecast is for."""

    def __init__(self, interval_s: float, horizon_s: float, alpha: float = 0.5, beta: float = 0.3,
                 phi: float = 0.98, default_prompt_tokens: float = 512.0, default_output_tokens: float = 128.0) -> None:
        if interval_s <= 0:
            raise ConfigError("interval_s", f"must be > 0, got {interval_s}")
        if horizon_s < 0:
            raise ConfigError("horizon_s", f"must be >= 0, got {horizon_s}")
        self.interval_s, self.horizon_s = interval_s, horizon_s
        self.rate = Holt(alpha, beta, phi)
        self.prompt = Holt(alpha, beta, phi, has_trend=False)
        self.output = Holt(alpha, beta, phi, has_trend=False)
        self.default_prompt_tokens = default_prompt_tokens
        self.default_output_tokens = default_output_tokens

    def update(self, sample: LoadSample) -> None:
        self.rate.update(sample.rate_rps)
        if sample.mean_prompt_tokens is not None:
            self.prompt.update(sample.mean_prompt_tokens)
        if sample.mean_output_tokens is not None:
            self.output.update(sample.mean_output_tokens)

    def forecast(self, horizon_s: float | None = None, age_s: float = 0.0) -> LoadForecast:
        """The load `horizon_s` (default: the configured horizon) from now, the rate's trend carried over the horizon
        plus `age_s`, how far behind now the readings are centred (`ClusterReading.age_s`: a rate over a window
        describes its middle)."""
        horizon = self.horizon_s if horizon_s is None else horizon_s
        steps = (horizon + max(0.0, age_s)) / self.interval_s
        prompt = self.prompt.forecast(0)  # the smoothed mix, not its noise, carried ahead
        output = self.output.forecast(0)
        return LoadForecast(horizon, self.rate.forecast(steps) or 0.0,
                            self.default_prompt_tokens if prompt is None else prompt,
                            self.default_output_tokens if output is None else output)

    def to_dict(self) -> dict[str, dict[str, float | int | None]]:
        return {"rate": self.rate.to_dict(), "prompt": self.prompt.to_dict(), "output": self.output.to_dict()}

    def load_dict(self, state: dict[str, dict[str, float | int | None]]) -> None:
        """Restore the level, trend and observation count `to_dict` saved (a controller restart, a changed
        config); the smoothing factors stay this forecaster's own (the config's), not the saved ones."""
        for name in ("rate", "prompt", "output"):
            saved, mine = Holt.from_dict(state[name]), getattr(self, name)
            mine.level, mine.num_observations = saved.level, saved.num_observations
            mine.trend = saved.trend if mine.has_trend else 0.0  # a length's trend saved before it had none

