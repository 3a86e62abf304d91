"""Empirical samplers for benchmarks.replay_split, drawn from one step log's own records instead of a parametric
form: step-time residuals (measured / fitted, per side and SM entry) and the two delays the workers add that the
replay's timing does not already hold (front -> prefill worker, prefill -> decode hand-off).

The delays, and what is subtracted from them. A worker reads its pipe once per step, at the top of its loop
(`WorkerBase.run`, after `step()` has launched step k+1 and collected step k), and at once while idle; so does the
prefill worker in runs without the plan lead (`prefill_plan_lead_ms: null`, every run before the thirty-first session;
with the lead, the default since, `PrefillWorker.wait_to_plan` reads arrivals during the step too, the measured
front -> worker delay is ~0.3 ms, and what is kept below is ~0). It plans its next
batch right after that read. `FirstTokenLog.received` stamps the read: `to_worker_ms` = read - the front's send
(`AddRequest.arrival_s`). The decode worker's `handoff` record stamps its take: `hop_ms` = take - the prefill
worker's send. The replay already makes an arrival wait for the prefill side's next plan (at its next step
boundary) and a hand-off for decode's next step boundary, so most of either is modelled already. What is kept
is a LOWER BOUND on the time the message spent in transit (front busy, pipe): with the side's step records
(`t`, written at each collect, just before the read that follows it) between the send and the read, a message
read after the second of them had missed at least one read, and is charged (last record but one before the
read) - send; one read after zero or one record is charged 0 (it may have missed no read); one sent while that
side was idle (no step of it in flight) is charged all of read - send. The read moment itself lags the step
end by the next step's launch (host time), which the replay leaves out on both sides of the comparison.
"""

from __future__ import annotations

import bisect
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from benchmarks.refit_from_steps import sample_of
from benchmarks.replay_split.fits import StepModel, entry_of

NOISES = ("lognormal", "empirical", "empirical-iid")  # --noise: fitted x lognormal, x logged residuals in
# blocks (persistence from the log), x logged residuals drawn independently
MIN_RESIDUALS = 20  # an SM entry needs this many logged steps for its own residual set; else the side's pooled set


def logged_steps(log_records: Sequence[dict]) -> list[dict]:
    """The log's prefill and decode steps the fits use (measured, not across a switch), in log order."""
    return [r for r in log_records if r.get("kind") == "step" and r.get("phase") in ("prefill", "decode")
            and r.get("measured_ms", 0) > 0 and not r.get("across_switch")]


def residual_sets(log_records: Sequence[dict], steps: StepModel) -> dict[tuple[str, int, bool] | str, list[float]]:
    """measured / fitted of each logged step, in log order: per (phase, SMs, other busy) entry with at least
    MIN_RESIDUALS steps, and per phase (every step of that phase, key the phase name)."""
    sets: dict[tuple[str, int, bool] | str, list[float]] = {}
    for r in logged_steps(log_records):
        phase, sms, busy = entry_of(r)
        ratio = r["measured_ms"] / 1e3 / steps.seconds(sample_of(r).shape, sms, busy)
        sets.setdefault((phase, sms, busy), []).append(ratio)
        sets.setdefault(phase, []).append(ratio)
    return {k: v for k, v in sets.items() if isinstance(k, str) or len(v) >= MIN_RESIDUALS}


def lag_autocorrelation(values: Sequence[float], lag: int = 1) -> float:
    """Pearson correlation of log(values) with itself `lag` steps later (nan with too few values)."""
    logs = [math.log(v) for v in values]
    if len(logs) <= lag + 2:
        return math.nan
    a, b = logs[:-lag], logs[lag:]
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    var = math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))
    return cov / var if var > 0 else math.nan


@dataclass
class ResidualNoise:
    """Draws a step's measured / fitted ratio from the log's own set for its entry (else its phase). With
    `block_steps` > 1 the draws persist: each set keeps a cursor that moves to the next logged residual, and jumps
    to a random one with probability 1 / block_steps (a stationary bootstrap: blocks of mean length
    `block_steps`), so a run of slow logged steps stays a run. `block_steps` per phase; 1 (or absent): independent."""
    sets: dict[tuple[str, int, bool] | str, list[float]]
    block_steps: dict[str, float] = field(default_factory=dict)
    _cursor: dict[tuple[str, int, bool] | str, int] = field(default_factory=dict)

    def reset(self) -> None:
        self._cursor.clear()

    def ratio(self, phase: str, sms: int, other_busy: bool, rng: random.Random) -> float:
        key: tuple[str, int, bool] | str = (phase, sms, other_busy)
        if key not in self.sets:
            key = phase
        values = self.sets[key]
        at, block = self._cursor.get(key), self.block_steps.get(phase, 1.0)
        if at is None or block <= 1 or rng.random() < 1 / block:
            at = rng.randrange(len(values))
        else:
            at = (at + 1) % len(values)
        self._cursor[key] = at
        return values[at]


def block_steps_of(sets: dict[tuple[str, int, bool] | str, list[float]]) -> dict[str, float]:
    """Mean block length per phase from the log's lag-1 autocorrelation r of log(residual), over the phase's
    steps in log order: 1 / (1 - r) (an AR(1)'s correlation length), 1 where r <= 0."""
    out = {}
    for phase in ("prefill", "decode"):
        r = lag_autocorrelation(sets.get(phase, []))
        out[phase] = 1.0 / (1.0 - r) if r > 0 and not math.isnan(r) else 1.0
    return out


def residual_noise(log_records: Sequence[dict], steps: StepModel, persistent: bool = True) -> ResidualNoise:
    """The log's residuals for `steps` (its fits), in blocks per `block_steps_of` (persistent) or independent."""
    sets = residual_sets(log_records, steps)
    return ResidualNoise(sets, block_steps_of(sets) if persistent else {})


def _side_steps(log_records: Sequence[dict], side: str) -> tuple[list[float], list[float]]:
    """(ends, starts) of a side's logged steps, by end: end = the record's `t`, start = end - measured."""
    rows = sorted((r["t"], r["t"] - r.get("measured_ms", 0.0) / 1e3) for r in log_records
                  if r.get("kind") == "step" and r.get("side") == side)
    return [e for e, _ in rows], [s for _, s in rows]


def transit_lower_bound(sent: float, read: float, ends: list[float], starts: list[float]) -> float:
    """The part of read - sent the replay does not model (module docstring), >= 0."""
    lo, hi = bisect.bisect_right(ends, sent), bisect.bisect_left(ends, read)  # records strictly between
    if hi - lo >= 2:
        return max(0.0, ends[hi - 2] - sent)
    if hi == lo and (lo >= len(ends) or starts[lo] > sent):  # nothing in flight at the send: read at once
        return max(0.0, read - sent)
    return 0.0


@dataclass(frozen=True)
class Delays:
    """Extra delays (s) drawn from one run window of the log (module docstring): `to_worker_s` per request,
    added before it reaches the prefill queue, and `handoff_s` per prefilled sequence, before it may join decode
    (in place of the replay's fixed relay). Also what they were cut from, for the report."""
    to_worker_s: tuple[float, ...]
    handoff_s: tuple[float, ...]
    raw_to_worker_s: tuple[float, ...] = ()
    raw_handoff_s: tuple[float, ...] = ()

    def draw_to_worker(self, rng: random.Random) -> float:
        return rng.choice(self.to_worker_s) if self.to_worker_s else 0.0

    def draw_handoff(self, rng: random.Random) -> float:
        return rng.choice(self.handoff_s) if self.handoff_s else 0.0


def delays_from_log(log_records: Sequence[dict], start_unix_s: float, end_unix_s: float) -> Delays:
    """The run window's `first_token` and `handoff` records (their `t` in [start, end]), less the waits for a
    step boundary that the replay models (module docstring)."""
    window = [r for r in log_records if start_unix_s <= r.get("t", -1.0) <= end_unix_s]
    prefill, decode = _side_steps(log_records, "prefill"), _side_steps(log_records, "decode")
    to_worker, raw_to_worker, handoff, raw_handoff = [], [], [], []
    for r in window:
        if r.get("kind") == "first_token":
            sent = r["t"] - r["worker_ttft_ms"] / 1e3
            read = sent + r["to_worker_ms"] / 1e3
            raw_to_worker.append(r["to_worker_ms"] / 1e3)
            to_worker.append(transit_lower_bound(sent, read, *prefill))
        elif r.get("kind") == "handoff" and not r.get("dropped"):
            sent = r["t"] - r["hop_ms"] / 1e3
            raw_handoff.append(r["hop_ms"] / 1e3)
            handoff.append(transit_lower_bound(sent, r["t"], *decode))
    return Delays(tuple(to_worker), tuple(handoff), tuple(raw_to_worker), tuple(raw_handoff))
