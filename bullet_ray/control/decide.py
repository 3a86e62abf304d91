"""The controller's decision, pure: `decide(inputs, config, state) -> (Decision, new state)`.

Every interval the controller turns what it measured (per engine: latency percentiles, queue, split; for the
application: arrival rate and length mix) and what it forecast into:
- **replicas**: enough engines for max(measured, forecast) token demand at `target_utilization` of
  `engine_capacity_tokens_s` each, within [min_engines, the GPU budget]. Up at once (the forecast looks
  `horizon_s` ahead, so the new replica is ready when the load arrives, DOPD-style), down only after
  `scale_down_after` decisions in a row wanted fewer;
- **split bounds per engine** (min/max decode SMs, inside the operator's): decode's TPOT p90 over target while
  TTFT meets it -> the floor rises to the engine's decode SMs + `split_step_sms`; TTFT over while TPOT meets it
  -> the ceiling drops to its decode SMs - `split_step_sms`; otherwise the operator's bounds;
- **SLO targets**: the configured TTFT/TPOT targets (the engines' split policy and attainment use them);
- **admission**: `queue` while the budget covers the demand (engines keep their configured queue), `shed`
  when even the whole budget does not: a short queue (`shed_max_waiting`) and refusal of requests whose
  predicted TTFT misses the target, so admitted requests keep their SLO; back to `queue` once demand is under
  `SHED_EXIT` of the budget;
- **split bounds** moved from where an engine runs never leave the operator's [min, max].
Each decision carries its reasons; the controller logs it with its inputs and exports it as metrics.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from bullet_ray.control.config import ControllerConfig
from bullet_ray.control.forecast import LoadForecast, LoadSample

# the admission mode leaves `shed` only once demand is below this share of the budget (hysteresis)
SHED_EXIT = 0.9


@dataclass(frozen=True)
class EngineObservation:
    """One engine replica as the metrics show it (None: no sample yet)."""

    engine_id: str
    node_id: str | None = None
    num_running: float = 0.0
    num_waiting: float = 0.0
    kv_usage: float = 0.0
    decode_sms: float | None = None  # SMs the decode side runs on now
    ttft_p90_s: float | None = None  # over the last interval
    tpot_p90_s: float | None = None  # inter-token latency p90 over the last interval
    predicted_ttft_s: float | None = None


@dataclass(frozen=True)
class ControllerInputs:
    time_s: float  # wall clock (time.time()) of the reading
    engines: tuple[EngineObservation, ...]
    load: LoadSample  # measured over the last interval
    forecast: LoadForecast  # horizon_s ahead
    num_replicas: int  # engine replicas asked for now
    max_engines: int  # the engine budget (controller.engine_budget: config.max_engines or what the cluster holds)
    attainment: float | None = None  # share of requests finished within both targets, last interval


@dataclass(frozen=True)
class ControllerState:
    """What must survive a controller restart (persisted with each decision)."""

    seq: int = 0  # decisions made so far
    num_low_decisions: int = 0  # decisions in a row that wanted fewer replicas
    is_shedding: bool = False  # the last decision's admission mode was `shed` (it leaves it with a margin)


@dataclass(frozen=True)
class EngineDecision:
    """Pushed to one engine (`EngineReplica.apply_policy`); None keeps the engine's own setting."""

    engine_id: str  # "*" for engines not observed yet
    min_decode_sms: int | None = None
    max_decode_sms: int | None = None
    ttft_target_ms: float | None = None
    tpot_target_ms: float | None = None
    max_waiting_per_engine: int | None = None
    admission_ttft_s: float | None = None
    reason: str = ""


@dataclass(frozen=True)
class Decision:
    seq: int
    time_s: float
    num_replicas: int
    mode: Literal["queue", "shed"]
    demand_tokens_s: float  # max(measured, forecast) prompt + output tokens per second
    capacity_tokens_s: float  # of the replicas decided, at full load
    engines: tuple[EngineDecision, ...]
    default: EngineDecision  # for engines that appear before the next decision
    reasons: tuple[str, ...] = field(default_factory=tuple)

    def for_engine(self, engine_id: str) -> EngineDecision:
        for e in self.engines:
            if e.engine_id == engine_id:
                return e
        return self.default

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Decision:
        engines = tuple(EngineDecision(**e) for e in d["engines"])
        return cls(**{**d, "engines": engines, "default": EngineDecision(**d["default"]),
                      "reasons": tuple(d.get("reasons", ()))})


def _replicas(inputs: ControllerInputs, cfg: ControllerConfig, state: ControllerState,
              demand: float) -> tuple[int, int, str]:
    """(replicas, decisions-in-a-row-wanting-fewer, reason)."""
    per_engine = cfg.engine_capacity_tokens_s * cfg.target_utilization
    low, high = cfg.min_engines, max(cfg.min_engines, inputs.max_engines)
    needed = min(high, max(low, math.ceil(demand / per_engine - 1e-9)))
    now = min(high, max(low, inputs.num_replicas))
    if needed > now:
        return needed, 0, f"scale up {now}->{needed}: demand {demand:.0f} tok/s > {now} x {per_engine:.0f}"
    if needed < now:
        if state.num_low_decisions + 1 >= cfg.scale_down_after:
            return needed, 0, f"scale down {now}->{needed}: demand {demand:.0f} tok/s for " \
                              f"{cfg.scale_down_after} decisions"
        return now, state.num_low_decisions + 1, f"hold {now}: fewer wanted ({needed}) " \
                                                 f"{state.num_low_decisions + 1}/{cfg.scale_down_after}"
    return now, 0, f"hold {now}"


def _engine(obs: EngineObservation, cfg: ControllerConfig, ttft_s: float | None, tpot_s: float | None,
            admission: dict[str, Any]) -> EngineDecision:
    lo, hi = cfg.min_decode_sms, cfg.max_decode_sms
    reason = "operator bounds"
    ttft_over = ttft_s is not None and ((obs.ttft_p90_s is not None and obs.ttft_p90_s > ttft_s)
                                        or (obs.predicted_ttft_s is not None and obs.predicted_ttft_s > ttft_s))
    tpot_over = tpot_s is not None and obs.tpot_p90_s is not None and obs.tpot_p90_s > tpot_s
    if obs.decode_sms is not None and tpot_over != ttft_over:
        now = int(obs.decode_sms)
        # moved from where the engine runs now, but never outside the operator's [min, max]
        if tpot_over:
            lo = max(now + cfg.split_step_sms, cfg.min_decode_sms or 0)
            lo = lo if hi is None else min(hi, lo)
            reason = f"TPOT p90 {obs.tpot_p90_s:.3f}s over target: decode keeps >= {lo} SMs"
        else:
            hi = max(1, now - cfg.split_step_sms)
            hi = hi if cfg.max_decode_sms is None else min(cfg.max_decode_sms, hi)
            hi = hi if lo is None else max(lo, hi)
            reason = f"TTFT over target: decode gets <= {hi} SMs"
    return EngineDecision(obs.engine_id, lo, hi, cfg.ttft_target_ms, cfg.tpot_target_ms, reason=reason, **admission)


def measured_tokens_s(load: LoadSample, fc: LoadForecast) -> float:
    """Prompt + output tokens per second of the measured load: its rate times its lengths where it has them, else
    the forecast's."""
    prompt = load.mean_prompt_tokens if load.mean_prompt_tokens is not None else fc.mean_prompt_tokens
    output = load.mean_output_tokens if load.mean_output_tokens is not None else fc.mean_output_tokens
    return load.rate_rps * (prompt + output)


def demand_tokens_s(load: LoadSample, fc: LoadForecast) -> float:
    """What the engines are sized for: the larger of the measured load and the forecast (tokens per second)."""
    return max(measured_tokens_s(load, fc), fc.tokens_per_s)


def decide(inputs: ControllerInputs, cfg: ControllerConfig,
           state: ControllerState) -> tuple[Decision, ControllerState]:
    """One decision from one reading (see the module docstring)."""
    fc = inputs.forecast
    measured = measured_tokens_s(inputs.load, fc)
    demand = demand_tokens_s(inputs.load, fc)
    num_replicas, num_low, why_replicas = _replicas(inputs, cfg, state, demand)
    budget = cfg.engine_capacity_tokens_s * max(cfg.min_engines, inputs.max_engines)
    # shed once demand exceeds the budget, and queue again only once it falls SHED_EXIT below it: demand that
    # hovers at the budget would otherwise flip the engines' admission every interval
    is_shedding = demand > budget * (SHED_EXIT if state.is_shedding else 1.0)
    mode: Literal["queue", "shed"] = "shed" if is_shedding else "queue"
    ttft_s = None if cfg.ttft_target_ms is None else cfg.ttft_target_ms / 1e3
    tpot_s = None if cfg.tpot_target_ms is None else cfg.tpot_target_ms / 1e3
    admission: dict[str, Any] = {}
    if mode == "shed":
        admission = {"max_waiting_per_engine": cfg.shed_max_waiting, "admission_ttft_s": ttft_s}
    engines = tuple(_engine(obs, cfg, ttft_s, tpot_s, admission) for obs in inputs.engines)
    default = _engine(EngineObservation("*"), cfg, ttft_s, tpot_s, admission)
    reasons = (why_replicas, f"mode {mode}: demand {demand:.0f} tok/s (measured {measured:.0f}, forecast "
                             f"{fc.tokens_per_s:.0f} in {fc.horizon_s:.0f}s), budget {budget:.0f}")
    decision = Decision(state.seq + 1, inputs.time_s, num_replicas, mode, demand,
                        num_replicas * cfg.engine_capacity_tokens_s, engines, default, reasons)
    return decision, ControllerState(state.seq + 1, num_low, is_shedding)
