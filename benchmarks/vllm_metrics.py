"""vLLM's engine-side view of one rate of a sweep: its Prometheus counters and histograms (GET /metrics) read
before and after the rate's measured requests, and what changed in between.

Names checked against vLLM 0.24.0's vllm/v1/metrics/loggers.py (PrometheusStatLogger). How vLLM fills them
(vllm/v1/engine/async_llm.py output_handler, vllm/v1/metrics/stats.py IterationStats), which decides how to
read them:
- `vllm:iteration_tokens_total` is observed once per engine step that returned at least one request output
  (a step that only ran prompt chunks of unfinished prefills returns none and is not counted), with that
  step's generated tokens plus the computed prompt tokens of the requests whose prefill ENDED in it: a prompt
  chunked over three steps counts whole in the third. Its count is the number of steps, its sum / count the
  mean tokens per step; the distribution puts a chunked prompt's tokens in its last step.
- `vllm:request_{queue,prefill,decode,inference}_time_seconds` and `vllm:e2e_request_latency_seconds`: one
  observation per finished request; `vllm:time_to_first_token_seconds` per request, and
  `vllm:inter_token_latency_seconds` per generated token after the first (`vllm:time_per_output_token_seconds`
  before vLLM 0.11; read where the new name is absent).
- `vllm:num_preemptions_total`, `vllm:prompt_tokens_total`, `vllm:generation_tokens_total` and
  `vllm:request_success_total` (labelled by finish reason; summed here): counters.
vLLM has no other counter of engine steps. Every value is summed over labels (engine index, finish reason);
a metric absent from the page is listed under `missing`, never an error.

    from benchmarks.vllm_metrics import VllmMetricsProbe
    SystemSpec("vllm", url, probe=VllmMetricsProbe(url + "/metrics"))   # see benchmarks.compare.RateProbe
"""

from __future__ import annotations

import logging
import math
import time
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.compare import RateProbe

logger = logging.getLogger(__name__)

STEP_TOKENS = "vllm:iteration_tokens_total"  # histogram: tokens per engine step
COUNTERS = {  # figure name -> sample name (counters are exposed with the _total suffix)
    "num_preemptions": "vllm:num_preemptions_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "num_requests_finished": "vllm:request_success_total",
}
TIME_HISTOGRAMS = {  # figure name -> metric names, the first present one is read
    "queue": ("vllm:request_queue_time_seconds",),
    "prefill": ("vllm:request_prefill_time_seconds",),
    "decode": ("vllm:request_decode_time_seconds",),
    "inference": ("vllm:request_inference_time_seconds",),
    "e2e": ("vllm:e2e_request_latency_seconds",),
    "ttft": ("vllm:time_to_first_token_seconds",),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
}
HISTOGRAMS = (STEP_TOKENS, *(name for names in TIME_HISTOGRAMS.values() for name in names))
STEP_TOKEN_BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # STEP_TOKENS' buckets

# {sample name: {le: value}}: le is a bucket's upper bound as exposed ("8.0", "+Inf"), "" for other samples
Samples = dict[str, dict[str, float]]


def fetch_text(url: str, timeout_s: float = 10.0) -> str:
    """The text exposition page at `url` (GET)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.read().decode("utf-8")


def parse_samples(text: str, prefix: str = "vllm:") -> Samples:
    """Every sample of the metrics whose name starts with `prefix`, summed over all labels but `le`."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(prefix):
            continue
        for sample in family.samples:
            le = sample.labels.get("le", "")
            by_le = out.setdefault(sample.name, {})
            by_le[le] = by_le.get(le, 0.0) + sample.value
    return out


def difference(before: Samples, after: Samples, names: tuple[str, ...] | None = None) -> Samples:
    """after - before per sample (a sample absent before counts from 0); only `names` (sample names, or
    histogram names standing for their _bucket/_sum/_count samples) if given."""
    def wanted(sample: str) -> bool:
        return names is None or sample in names or sample.removesuffix("_bucket").removesuffix("_sum") \
            .removesuffix("_count") in names

    return {name: {le: value - before.get(name, {}).get(le, 0.0) for le, value in by_le.items()}
            for name, by_le in after.items() if wanted(name)}


def histogram(delta: Samples, name: str) -> dict[str, Any] | None:
    """count, sum and the non-cumulative count per bucket [(upper bound, n)] of histogram `name` in `delta`,
    in bucket order; None if it is absent."""
    if f"{name}_count" not in delta:
        return None
    cumulative = sorted(((float(le), n) for le, n in delta.get(f"{name}_bucket", {}).items()), key=lambda b: b[0])
    buckets, below = [], 0.0
    for bound, n in cumulative:
        buckets.append((bound, n - below))
        below = n
    return {"count": delta[f"{name}_count"][""], "sum": delta.get(f"{name}_sum", {}).get("", math.nan),
            "buckets": buckets}


def _token_range(lower: float, upper: float) -> str:
    """'2-8' for the integer token counts in (1, 8]; '<=1', '16385+'."""
    if math.isinf(upper):
        return f"{int(lower) + 1}+"
    if lower < 0:
        return f"<={int(upper)}"
    return f"{int(lower) + 1}-{int(upper)}" if upper > lower + 1 else f"{int(upper)}"


def steps_by_tokens(num_tokens: list[int], bounds: tuple[int, ...] = STEP_TOKEN_BOUNDS) -> dict[str, int]:
    """Steps per token range of vLLM's histogram (<=1, 2-8, ..., 16385+) from each step's token count: another
    engine's step log read the way step_figures reads vLLM's."""
    ranges, lower = {}, -1.0
    for upper in (*bounds, math.inf):
        ranges[_token_range(lower, upper)] = sum(1 for n in num_tokens if lower < n <= upper)
        lower = upper
    return ranges


def step_figures(delta: Samples) -> dict[str, Any] | None:
    """Steps, mean tokens per step and steps per token range from `vllm:iteration_tokens_total`'s delta."""
    h = histogram(delta, STEP_TOKENS)
    if h is None:
        return None
    lower, by_tokens = -1.0, {}
    for upper, n in h["buckets"]:
        by_tokens[_token_range(lower, upper)] = int(round(n))
        lower = upper
    num_steps = int(round(h["count"]))
    total = h["sum"]
    known = not math.isnan(total)  # a page without the histogram's _sum keeps the counts
    return {"num_steps": num_steps, "num_tokens": int(round(total)) if known else None,
            "tokens_per_step_mean": round(total / num_steps, 1) if num_steps and known else None,
            "steps_by_tokens": by_tokens}


def engine_figures(delta: Samples) -> dict[str, Any]:
    """What a reader wants from one rate's delta: steps (step_figures), counters, and per timing histogram the
    number of observations and their mean in ms; `missing` names what the page did not have."""
    missing: list[str] = []
    steps = step_figures(delta)
    if steps is None:
        missing.append(STEP_TOKENS)
    counters: dict[str, int | None] = {}
    for key, sample in COUNTERS.items():
        counters[key] = int(round(delta[sample][""])) if sample in delta else None
        if sample not in delta:
            missing.append(sample)
    times: dict[str, dict[str, Any] | None] = {}
    for key, names in TIME_HISTOGRAMS.items():
        found = next(((n, h) for n in names if (h := histogram(delta, n)) is not None), None)
        if found is None:
            missing.append(names[0])
            times[key] = None
            continue
        name, h = found
        count = int(round(h["count"]))
        times[key] = {"metric": name, "count": count,
                      "mean_ms": round(h["sum"] / count * 1e3, 2) if count else None}
    return {"steps": steps, "counters": counters, "time_ms": times, "missing": missing}


class VllmMetricsProbe(RateProbe):
    """Reads vLLM's /metrics before and after each rate; `finish` returns engine_figures of the difference
    and the difference itself (`delta`, the samples of the metrics above; histogram buckets cumulative, as
    exposed). `settle_s`: wait before the second read, so the last steps' stats are recorded."""

    name = "vllm_metrics"

    def __init__(self, url: str, timeout_s: float = 10.0, settle_s: float = 1.0) -> None:
        self.url, self.timeout_s, self.settle_s = url, timeout_s, settle_s
        self._before: Samples | None = None

    def start(self) -> None:
        self._before = None
        self._before = parse_samples(fetch_text(self.url, self.timeout_s))

    def finish(self) -> dict[str, Any]:
        if self._before is None:
            raise RuntimeError("finish without a successful start")
        time.sleep(self.settle_s)
        delta = difference(self._before, parse_samples(fetch_text(self.url, self.timeout_s)),
                           HISTOGRAMS + tuple(COUNTERS.values()))
        self._before = None
        return {"url": self.url, **engine_figures(delta), "delta": delta}
