"""What the controller reads each interval: the Prometheus HTTP API, or every Ray node's metrics export.

Both readers return one `ClusterReading`: the application's arrival rate and length mix over the last
window (a `LoadSample`), its SLO attainment, and per engine replica the gauges (queue, KV, decode SMs,
predicted TTFT) and latency p90s. `PrometheusReader` asks a Prometheus server with PromQL (the same series
the dashboards show); `NodeExporterReader` scrapes each node's export port itself (listed by `ray.nodes()`)
and takes rates and histogram quantiles from the difference between two scrapes a window apart, both taken just
after one of Ray's metrics exports, so it needs no server (a counter that went down was reset: its new value is
the increase, as Prometheus's increase() takes it; a histogram's reset is decided for all of its buckets
together, where Prometheus decides per bucket series).
Metric names: bullet_ray/metrics.py.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import time
import urllib.parse
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from bullet_ray.control.decide import EngineObservation
from bullet_ray.control.forecast import LoadSample

logger = logging.getLogger(__name__)

P = "ray_bullet_"
GAUGES = {"num_running": "num_requests_running", "num_waiting": "num_requests_waiting", "kv_usage": "kv_cache_usage_perc",
          "decode_sms": "sm_split_decode_sms", "predicted_ttft_s": "predicted_ttft_seconds"}
QUANTILES = {"ttft_p90_s": "time_to_first_token_seconds", "tpot_p90_s": "inter_token_latency_seconds"}
# NodeExporterReader's default rate window, in Ray's metrics export periods (see its docstring)
NUM_EXPORTS_PER_WINDOW = 3
# Ray's metrics export period when the cluster's cannot be read (Ray's default metrics_report_interval_ms)
RAY_DEFAULT_EXPORT_PERIOD_S = 10.0


@dataclass(frozen=True)
class ClusterReading:
    time_s: float
    load: LoadSample
    attainment: float | None
    engines: tuple[EngineObservation, ...]
    # a reader's first scrape: no interval yet, so its rates are not measurements (the controller skips it)
    is_baseline: bool = False
    # how long before `time_s` the window the rates were measured over is centred: a rate over a window describes its
    # middle, so a rising load reads that much behind (the controller's forecast looks that much further ahead)
    age_s: float = 0.0


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def _tokens_per_request(mean: float | None) -> float | None:
    """A window's mean tokens per request, or None when it has no reading. Every counted request has at least
    one prompt token and nearly every finished one at least one output token (an aborted one may have none), so
    a mean below one says the token counter lagged the request counter in the export (they are flushed by
    different processes), not that requests were empty: a forecast fed that 0 would see no demand until the
    lengths caught up. A counter that lags only in part still reads low; the forecast's smoothing absorbs it."""
    return None if mean is None or not math.isfinite(mean) or mean < 1.0 else mean


class PrometheusReader:
    """PromQL against `url` (http://host:port) over a `window_s` rate window."""

    def __init__(self, url: str, model_name: str, window_s: float = 30.0, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.selector = f'{{model_name="{model_name}"}}'
        self.window_s = max(int(window_s), 2)
        self.window = f"{self.window_s}s"
        self.timeout_s = timeout_s

    def query(self, promql: str) -> list[tuple[dict[str, str], float]]:
        """An instant query's (labels, value) samples; NaN and infinite ones dropped (a ratio over a window where
        its denominator did not move: tokens streamed but no request finished)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:
            body = json.load(resp)
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus query {promql!r} failed: {body.get('error')}")
        out = []
        for item in body["data"]["result"]:
            value = float(item["value"][1])
            if math.isfinite(value):
                out.append((item["metric"], value))
        return out

    def _scalar(self, promql: str) -> float | None:
        rows = self.query(promql)
        return rows[0][1] if rows else None

    def _rate(self, name: str, extra: str = "") -> str:
        sel = self.selector if not extra else self.selector[:-1] + f",{extra}}}"
        return f"sum(rate({P}{name}{sel}[{self.window}]))"

    def read(self) -> ClusterReading:
        rate = self._scalar(self._rate("requests_arrived_total")) or 0.0
        prompt = self._scalar(f"{self._rate('prompt_tokens_total')} / {self._rate('time_to_first_token_seconds_count')}")
        output = self._scalar(f"{self._rate('generation_tokens_total')} / "
                              f"{self._rate('e2e_request_latency_seconds_count')}")
        attainment = self._scalar(f"{self._rate('request_slo_total', 'slo_met=' + chr(34) + 'true' + chr(34))} / "
                                  f"{self._rate('request_slo_total')}")
        by_engine: dict[str, dict[str, float]] = defaultdict(dict)
        for field, name in GAUGES.items():
            for labels, value in self.query(f"max by (engine) ({P}{name}{self.selector})"):
                by_engine[labels.get("engine", "")][field] = value
        for field, name in QUANTILES.items():
            q = f"histogram_quantile(0.9, sum by (engine, le) (rate({P}{name}_bucket{self.selector}[{self.window}])))"
            for labels, value in self.query(q):
                by_engine[labels.get("engine", "")][field] = value
        return ClusterReading(time.time(), LoadSample(rate, _tokens_per_request(prompt), _tokens_per_request(output)),
                              attainment, _engines(by_engine), age_s=self.window_s / 2)


def _engines(by_engine: dict[str, dict[str, float]]) -> tuple[EngineObservation, ...]:
    return tuple(EngineObservation(engine_id, **fields) for engine_id, fields in sorted(by_engine.items())  # type: ignore[arg-type]
                 if engine_id)


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile on cumulative bucket counts {le: count} (linear inside a bucket)."""
    if not buckets:
        return None
    les = sorted(buckets)
    total = buckets[les[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le in les:
        count = buckets[le]
        if count >= rank:
            if le == float("inf"):
                return prev_le
            width = count - prev_count
            return prev_le + (le - prev_le) * ((rank - prev_count) / width if width > 0 else 1.0)
        prev_le, prev_count = le, count
    return les[-1]


Series = tuple[str, frozenset[tuple[str, str]]]

# a counter's series, as Ray's exporter names them: a counter's `_total`, a histogram's `_bucket`, `_count` and `_sum`
COUNTER_SUFFIXES = ("_total", "_bucket", "_count", "_sum")


@dataclass(frozen=True)
class _Scrape:
    """One scrape of every node: when it was taken, and its samples."""

    time_s: float
    samples: dict[Series, float]
    # False for a reader's first scrape only: its values were exported some time before it (up to one export
    # period), so it cannot start a window that holds a change
    is_aligned: bool = True


def _counters_changed(cur: dict[Series, float], prev: dict[Series, float]) -> bool:
    """Whether an export landed between two scrapes: a counter series has another value, or appeared (a process
    exported it for the first time). A series also reappears when a node answers again after missing a scrape; that
    edge lags its export by up to one export period instead of one read interval: a small error, while that edge
    ends or starts the window."""
    return any(key not in prev or value != prev[key] for key, value in cur.items()
               if key[0].endswith(COUNTER_SUFFIXES))


def _has_counters(samples: dict[Series, float]) -> bool:
    return any(key[0].endswith(COUNTER_SUFFIXES) for key in samples)


class NodeExporterReader:
    """Scrapes every node's metrics export port; rates over a window of `window_s` seconds of scrapes.

    The counters on an export page change only when Ray's metrics agent exports (every export period: 10 s by
    default, 2 s in the tests), so the change between two consecutive reads holds zero, one or two exports: a
    steady 10 req/s read every 2.35 s with a 2 s export period read ~8.5 and ~17 req/s by turns, and a 10 s
    export period read every 5 s read 0 and twice the rate by turns. The reader therefore keeps the scrapes where
    a counter changed since the scrape before ("edges": an export landed in between) and takes every rate,
    ratio and quantile from the change between the newest edge and the newest edge at least `window_s` older than
    it (the oldest kept while the history is shorter), over the time between those two edges. An edge lags its export by
    less than one read interval, so the rate's error is below (read interval / window), where one pair of reads
    could be off by 2x or read 0.

    Until two edges are kept a reading is a baseline (`is_baseline`, rate 0): no interval measured yet. The first
    scrape is no edge (its values were exported up to one export period before it: a change right after it would
    be counted over too short a time), except that a window without any change after it measures 0. A scrape
    taken more than `window_s` after the newest edge is an edge too, though nothing changed: no counter moved in a
    whole window, so the rate is 0 (the load stopped; without it the last rate would be read forever), and when
    the load comes back its first exports are counted over a window that starts no earlier than the edge before
    that quiet one.

    Each series counts from the oldest edge of the window that holds it: a node that missed a scrape, or a replica
    that started within the window, counts its change since it was first seen there, never its lifetime total as
    one window's, and a series the newest edge lacks (a node that did not answer, a replica gone) counts nothing. A
    scrape where no node answered is skipped. A counter that went down between the two edges was reset (`_increase`,
    `_bucket_increases`); as with any two samples, what it counted before its reset within the window is lost.
    Gauges come from the newest scrape, edge or not. The history holds the edges of one window and one more, so
    its memory is bounded by window_s / the read interval.

    `window_s` None (the default) takes `NUM_EXPORTS_PER_WINDOW` (3) of the cluster's export periods: 30 s with Ray's
    10 s (as `PrometheusReader`'s 30 s), 6 s with the tests' 2 s. A longer window reads a steady load closer (2 s
    exports read every 2.35 s: within -15%/+13% over 6 s, -15%/+6% over 8 s, -2%/+5% over 30 s) but lags a
    changing one by about half of it (`ClusterReading.age_s`: the controller's forecast looks that much further
    ahead), and the controller's forecast takes its trend from these readings. In the integration test's rising load (0.3 + 0.1 req/s each second, 2 s exports, a decision every ~2.3 s, a second
    replica due before 23.7 s) the controller asked for it 9.8, 13.3 and 15.4 s into the rise with 3 export
    periods, 17.7 and 21.9 s with 4, and 25.3 s in one run that read two consecutive scrapes; an offline model of
    that loop put a 30 s window past the deadline in 16 of 20 runs. The window must also stay longer than an
    export period plus a read interval, or a quiet stretch between two exports would read as a stopped load.

    `clock` gives the time of a scrape (tests inject one instead of sleeping).
    """

    def __init__(self, model_name: str, endpoints: Callable[[], Iterable[str]] | None = None,
                 timeout_s: float = 5.0, window_s: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if window_s is None:
            window_s = NUM_EXPORTS_PER_WINDOW * ray_export_period_s()
        if not window_s > 0:
            raise ValueError(f"NodeExporterReader window_s must be > 0 seconds (or None: {NUM_EXPORTS_PER_WINDOW} "
                             f"of Ray's metrics export periods), got {window_s}")
        self.model_name = model_name
        self.endpoints = endpoints or ray_node_endpoints
        self.timeout_s = timeout_s
        self.window_s = window_s
        self.clock = clock
        self._prev: dict[Series, float] | None = None  # the last scrape's samples, to tell an edge
        self._edges: collections.deque[_Scrape] = collections.deque()  # oldest first

    def scrape(self) -> dict[Series, float]:
        return scrape_samples(self.endpoints(), lambda name, labels: name.startswith(P)
                              and labels.get("model_name") == self.model_name, self.timeout_s)

    def read(self) -> ClusterReading:
        """The rates over the window ending at the newest edge, and the gauges now (see the class docstring)."""
        now, cur = self.clock(), self.scrape()
        self._add(_Scrape(now, cur))
        if len(self._edges) < 2:
            return _window_reading(now, cur, cur, cur, 0.0, is_baseline=True)
        first, last = self._edges[0], self._edges[-1]
        before: dict[Series, float] = {}
        for edge in list(self._edges)[:-1]:  # each series from the oldest edge that holds it
            for key, value in edge.samples.items():
                before.setdefault(key, value)
        return _window_reading(now, cur, before, last.samples, last.time_s - first.time_s,
                               age_s=now - (first.time_s + last.time_s) / 2)

    def _add(self, scrape: _Scrape) -> None:
        """Keep `scrape` if it is an edge, then drop the edges no window needs any more. A scrape without any counter
        series after one with some (every node failed to answer) is no scrape: neither an edge nor the one the next
        is compared with, or an idle stretch could keep it as its quiet edge and a later window start from nothing."""
        if self._prev is not None and _has_counters(self._prev) and not _has_counters(scrape.samples):
            return
        prev, self._prev = self._prev, scrape.samples
        if prev is None:
            self._edges.append(_Scrape(scrape.time_s, scrape.samples, is_aligned=False))
            return
        if _counters_changed(scrape.samples, prev):
            if len(self._edges) == 1 and not self._edges[0].is_aligned:
                self._edges.clear()  # a change right after the first scrape: count it from this edge on
            self._edges.append(scrape)
        elif scrape.time_s - self._edges[-1].time_s > self.window_s:
            self._edges.append(scrape)  # nothing changed in a whole window
        # the window starts at the newest edge at least window_s before the newest one: the older ones go
        while len(self._edges) > 1 and self._edges[-1].time_s - self._edges[1].time_s >= self.window_s:
            self._edges.popleft()


def _window_reading(now: float, gauges: dict[Series, float], before: dict[Series, float], after: dict[Series, float],
                    span_s: float, is_baseline: bool = False, age_s: float = 0.0) -> ClusterReading:
    """The reading of the change from `before` (each series at the window's start, or where the window first holds
    it) to `after` (the window's end, `span_s` after its start; the same scrape for a baseline: no change), with the
    gauges of `gauges` (the newest scrape)."""
    def delta(name: str, where: Callable[[dict[str, str]], bool] = lambda _: True) -> float:
        return sum(_increase(v, before[k]) for k, v in after.items()
                   if k[0] == P + name and k in before and where(dict(k[1])))

    rate = delta("requests_arrived_total") / span_s if span_s > 0 else 0.0
    prompt = _ratio(delta("prompt_tokens_total"), delta("time_to_first_token_seconds_count"))
    output = _ratio(delta("generation_tokens_total"), delta("e2e_request_latency_seconds_count"))
    attainment = _ratio(delta("request_slo_total", lambda lb: lb.get("slo_met") == "true"),
                        delta("request_slo_total"))
    by_engine: dict[str, dict[str, float]] = defaultdict(dict)
    for (name, labels), value in gauges.items():
        lb = dict(labels)
        for field, gauge in GAUGES.items():
            if name == P + gauge:
                by_engine[lb.get("engine", "")][field] = value
    for field, hist in QUANTILES.items():
        for engine, b in _bucket_increases(P + hist, after, before).items():
            value_q = histogram_quantile(0.9, b)
            if value_q is not None:
                by_engine[engine][field] = value_q
    return ClusterReading(now, LoadSample(rate, _tokens_per_request(prompt), _tokens_per_request(output)),
                          attainment, _engines(by_engine), is_baseline=is_baseline, age_s=age_s)


def _increase(now: float, before: float) -> float:
    """A counter's increase between two scrapes, as Prometheus's increase() takes it: a counter that went down was
    reset (the process exporting it restarted) and counted again from zero, so all of its value is new."""
    return now - before if now >= before else now


def _bucket_increases(hist: str, cur: dict[Series, float], prev: dict[Series, float]) -> dict[str, dict[float, float]]:
    """Per engine, the increase of histogram `hist`'s cumulative buckets {le: count} between two scrapes. A reset is
    decided for a whole histogram (its series with the same labels but `le`): if any of its buckets or its count went
    down, all of its new counts are the increase. Each bucket clipped at 0 on its own instead left counts that are
    not cumulative (a bucket below the one before it) and a wrong quantile, or none. Only buckets both scrapes hold
    count (see `NodeExporterReader`)."""
    pairs: dict[frozenset[tuple[str, str]], dict[float, tuple[float, float]]] = defaultdict(dict)
    for key, now in cur.items():
        if key[0] == hist + "_bucket" and key in prev:
            others = dict(key[1])
            le = float(others.pop("le"))
            pairs[frozenset(others.items())][le] = (now, prev[key])
    out: dict[str, dict[float, float]] = defaultdict(dict)
    for labels, by_le in pairs.items():
        count = (hist + "_count", labels)
        is_reset = any(now < before for now, before in by_le.values()) \
            or (count in cur and count in prev and cur[count] < prev[count])
        buckets = out[dict(labels).get("engine", "")]
        for le, (now, before) in by_le.items():
            buckets[le] = buckets.get(le, 0.0) + (now if is_reset else now - before)
    return out


def scrape_samples(urls: Iterable[str], keep: Callable[[str, dict[str, str]], bool],
                   timeout_s: float = 5.0) -> dict[Series, float]:
    """The samples `keep(name, labels)` selects from every metrics page in `urls` (a series two pages both hold
    summed); a page that does not answer is left out with a warning."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[Series, float] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                text = resp.read().decode()
        except OSError as e:
            logger.warning("cannot scrape %s: %s", url, e)
            continue
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if keep(s.name, s.labels):
                    key = (s.name, frozenset(s.labels.items()))
                    out[key] = out.get(key, 0.0) + float(s.value)
    return out


def ray_node_endpoints() -> list[str]:
    """The metrics export URL of every alive Ray node."""
    import ray

    return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics" for n in ray.nodes()
            if n.get("Alive") and n.get("MetricsExportPort")]


def ray_export_period_s() -> float:
    """How often Ray's metrics agent exports (s): the cluster's metrics_report_interval_ms, which Ray floors at one
    second (10 s unless the cluster set it; read in the process, where Ray passes the cluster's system config)."""
    import ray

    try:
        return max(ray._config.metrics_report_interval_ms(), 1000) / 1000.0
    except Exception:  # noqa: BLE001 - a Ray without this (private) config reader, or one that cannot read it now
        logger.warning("cannot read Ray's metrics export period; taking Ray's default %.0f s", RAY_DEFAULT_EXPORT_PERIOD_S)
        return RAY_DEFAULT_EXPORT_PERIOD_S
