"""The node-exporter reader on canned exposition text and on modelled exports (no Ray, no server, no sleeps:
the reader's clock is injected) and the quantile helper."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import pytest

from bullet_ray.control.readings import ClusterReading, NodeExporterReader, histogram_quantile
from tests.metrics_pages import serve_pages


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = {0.1: 10.0, 0.5: 90.0, 1.0: 100.0, float("inf"): 100.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 40 / 80)
    assert histogram_quantile(0.9, buckets) == pytest.approx(0.5)
    assert histogram_quantile(0.9, {0.1: 0.0, float("inf"): 0.0}) is None


def exposition(arrived: float, ttft_fast: float, ttft_all: float, prompt_tokens: float | None = None) -> str:
    lab = 'model_name="m",engine="e1"'
    return "\n".join([
        "# TYPE ray_bullet_requests_arrived_total counter", f"ray_bullet_requests_arrived_total{{{lab}}} {arrived}",
        "# TYPE ray_bullet_num_requests_waiting gauge", f"ray_bullet_num_requests_waiting{{{lab}}} 3",
        "# TYPE ray_bullet_time_to_first_token_seconds histogram",
        f'ray_bullet_time_to_first_token_seconds_bucket{{{lab},le="0.1"}} {ttft_fast}',
        f'ray_bullet_time_to_first_token_seconds_bucket{{{lab},le="+Inf"}} {ttft_all}',
        f"ray_bullet_time_to_first_token_seconds_count{{{lab}}} {ttft_all}",
        f"ray_bullet_time_to_first_token_seconds_sum{{{lab}}} 1.0",
        "# TYPE ray_bullet_prompt_tokens_total counter", f"ray_bullet_prompt_tokens_total{{{lab}}} {ttft_all * 10 if prompt_tokens is None else prompt_tokens}",
        "# TYPE ray_bullet_request_slo_total counter",
        f'ray_bullet_request_slo_total{{{lab},slo_met="true"}} {ttft_fast}',
        f'ray_bullet_request_slo_total{{{lab},slo_met="false"}} {ttft_all - ttft_fast}',
        'ray_bullet_num_requests_waiting{model_name="other",engine="x"} 9', ""])


@pytest.mark.parametrize("lagging_tokens", [False, True])
def test_node_exporter_reader_rates_and_per_engine_values(lagging_tokens):
    # lagging: 20 more first tokens but the prompt-token counter not yet moved (another process flushes it)
    # the reader starts before the engine's first export (an empty page): the rates need two exports after it
    pages = ["", exposition(10, 5, 10), exposition(30, 10, 30, prompt_tokens=100.0 if lagging_tokens else None)]

    with serve_pages(pages) as port:
        url = f"http://127.0.0.1:{port}/metrics"
        reader = NodeExporterReader("m", endpoints=lambda: [url], window_s=30.0)
        first = reader.read()
        assert first.is_baseline and first.load.rate_rps == 0.0  # one scrape: no rate yet (the controller skips it)
        pages.pop(0)
        one_export = reader.read()
        assert one_export.is_baseline and one_export.load.rate_rps == 0.0  # one export seen: no interval yet
        pages.pop(0)
        second = reader.read()
        assert second.load.rate_rps > 0
        # a lagging counter is no reading (None), never a mean of 0 tokens that would forecast no demand
        assert second.load.mean_prompt_tokens == (None if lagging_tokens else pytest.approx(10.0))
        assert second.attainment == pytest.approx(5 / 20)
        (engine,) = second.engines
        assert engine.engine_id == "e1" and engine.num_waiting == 3
        assert engine.ttft_p90_s == pytest.approx(0.1)  # 15 of the 20 new ones were slower: the last finite bound
        assert not second.is_baseline


def test_a_node_that_missed_a_scrape_counts_no_lifetime_total_as_one_interval():
    """Scrapes one second apart: none exported yet, both nodes, then node b fails, then both again: b's counter
    counts only where both ends of the window saw it, never its whole total as one window's arrivals (which
    decided the GPU budget at once)."""
    def page(arrived: float, engine: str) -> str:
        return (f'# TYPE ray_bullet_requests_arrived_total counter\n'
                f'ray_bullet_requests_arrived_total{{model_name="m",engine="{engine}"}} {arrived}\n')

    scrapes = [{}, {"a": page(100, "a"), "b": page(1_000_000, "b")}, {"a": page(110, "a")},
               {"a": page(120, "a"), "b": page(1_000_020, "b")}]
    # a 1 s window: each reading spans the last two scrapes, as a two-scrape rate did
    readings = _read_pages(scrapes, window_s=1.0)
    assert [r.is_baseline for r in readings] == [True, True, False, False]
    # a's 10 each time; b not in the third scrape's window (its second scrape lacked it), never its million
    assert [r.load.rate_rps for r in readings[2:]] == [pytest.approx(10.0), pytest.approx(10.0)]
    # a 30 s window spans from the first export on: b counts from there (both ends hold it), a and b 20 each
    readings = _read_pages(scrapes, window_s=30.0)
    assert [r.load.rate_rps for r in readings[2:]] == [pytest.approx(10.0), pytest.approx(40.0 / 2)]


def _read_pages(scrapes: list[dict[str, str]], window_s: float = 30.0,
                every_s: float = 1.0) -> list[ClusterReading]:
    """The readings of a reader scraping `scrapes` (each: the text of every node's page), one every `every_s`."""
    now = [0.0]
    reader = NodeExporterReader("m", endpoints=lambda: [], window_s=window_s, clock=lambda: now[0])
    readings = []
    for i, pages in enumerate(scrapes):
        now[0] = i * every_s
        reader.scrape = lambda pages=pages: _parsed(pages)  # type: ignore[method-assign,misc]
        readings.append(reader.read())
    return readings


def _parsed(pages: dict[str, str]) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {}
    for text in pages.values():
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def test_non_finite_readings_never_reach_the_forecast():
    """An infinite mean length (tokens streamed, no request finished in the window) or NaN is no reading: the
    smoother keeps its level instead of turning NaN for good."""
    import math

    from bullet_ray.control.forecast import Holt
    from bullet_ray.control.readings import _tokens_per_request

    assert _tokens_per_request(math.inf) is None and _tokens_per_request(math.nan) is None
    assert _tokens_per_request(200.0) == 200.0
    h = Holt()
    for value in (100.0, 110.0, math.inf, math.nan, -1.0, 120.0):
        h.update(value)
    assert h.num_observations == 3 and math.isfinite(h.level) and math.isfinite(h.trend)


def test_the_controller_skips_a_baseline_reading():
    """A reader's first scrape measures no interval: the controller neither feeds its 0 req/s to the forecast
    (it would seed a trend of the whole rate at the next reading) nor decides on it."""
    from types import SimpleNamespace

    from bullet_ray.control.controller import ClusterController
    from bullet_ray.control.forecast import LoadSample
    from bullet_ray.control.readings import ClusterReading

    updates: list = []
    fake = SimpleNamespace(_lock=threading.Lock(), forecaster=SimpleNamespace(update=updates.append))
    baseline = ClusterReading(1.0, LoadSample(0.0, None, None), None, (), is_baseline=True)
    assert ClusterController.tick(fake, baseline) == {"baseline": True, "time_s": 1.0}  # type: ignore[arg-type]
    assert updates == []


def _ttft_page(buckets: dict[str, float], worker: str = "w1") -> str:
    """One process's TTFT histogram of engine e1: cumulative counts by bound, its count the +Inf bucket."""
    lab = f'model_name="m",engine="e1",WorkerId="{worker}"'
    lines = [f'ray_bullet_time_to_first_token_seconds_bucket{{{lab},le="{le}"}} {n}' for le, n in buckets.items()]
    return "\n".join(["# TYPE ray_bullet_time_to_first_token_seconds histogram", *lines,
                      f"ray_bullet_time_to_first_token_seconds_count{{{lab}}} {buckets['+Inf']}",
                      f"ray_bullet_time_to_first_token_seconds_sum{{{lab}}} 1.0", ""])


def _read_twice(first: dict[str, str], second: dict[str, str]):
    """The reading over two exports, from a reader that started before the first."""
    return _read_pages([{}, first, second])[-1]


def test_a_reset_histogram_counts_its_new_values_whole():
    """The process behind a histogram restarted between two scrapes (its 0.1 s bucket fell from 100 to 0, while
    its count rose from 100 to 110): its new cumulative counts are the interval's increase, as Prometheus's
    increase() takes them. Clipping each bucket's difference at 0 instead gave {0.1: 0, 0.5: 1, 1: 10, +Inf: 10}
    and a p90 of 0.94 s; the 110 requests since the restart put 101 of them under 0.5 s: p90 0.49 s."""
    before = {"0.1": 100, "0.5": 100, "1.0": 100, "+Inf": 100}
    after = {"0.1": 0, "0.5": 101, "1.0": 110, "+Inf": 110}
    (engine,) = _read_twice({"n": _ttft_page(before)}, {"n": _ttft_page(after)}).engines
    assert engine.ttft_p90_s == pytest.approx(0.1 + 0.4 * 99 / 101)


def test_a_reset_is_decided_per_histogram_not_per_engine():
    """Two processes export engine e1's histogram (two WorkerIds): only the restarted one counts whole; the other
    counts its difference. Both sum into the engine's buckets."""
    steady_before = {"0.1": 50, "0.5": 50, "1.0": 50, "+Inf": 50}
    steady_after = {"0.1": 50, "0.5": 50, "1.0": 60, "+Inf": 60}  # 10 new ones between 0.5 and 1 s
    reset_before = {"0.1": 100, "0.5": 100, "1.0": 100, "+Inf": 100}
    reset_after = {"0.1": 90, "0.5": 90, "1.0": 90, "+Inf": 90}  # 90 new ones under 0.1 s (every bucket went down)
    first = {"a": _ttft_page(steady_before, "w1"), "b": _ttft_page(reset_before, "w2")}
    second = {"a": _ttft_page(steady_after, "w1"), "b": _ttft_page(reset_after, "w2")}
    (engine,) = _read_twice(first, second).engines
    # 100 new: 90 under 0.1 s, 10 in (0.5, 1]: p90 at rank 90, the 0.1 s bound (clipped: no new requests, no p90)
    assert engine.ttft_p90_s == pytest.approx(0.1)


def test_a_reset_counter_counts_its_new_value():
    """A counter that went down was reset: all of its new value is the interval's (increase()), not 0."""
    def page(arrived: float) -> str:
        return (f'# TYPE ray_bullet_requests_arrived_total counter\n'
                f'ray_bullet_requests_arrived_total{{model_name="m",engine="a"}} {arrived}\n')

    after = _read_twice({"a": page(100)}, {"a": page(5)})
    assert after.load.rate_rps * 1.0 == pytest.approx(5.0)  # the two exports' scrapes were 1 s apart


# --- the window: a node whose metrics agent exports every export period, read at another period ------------------

ARRIVED = ("ray_bullet_requests_arrived_total", frozenset({("model_name", "m"), ("engine", "e1")}))
PROMPT_TOKENS = ("ray_bullet_prompt_tokens_total", frozenset({("model_name", "m"), ("engine", "e1")}))
FIRST_TOKENS = ("ray_bullet_time_to_first_token_seconds_count", frozenset({("model_name", "m"), ("engine", "e1")}))


def _read_exports(arrived: Callable[[float], float], export_s: float, read_times: list[float],
                  window_s: float) -> list[ClusterReading]:
    """The readings at `read_times` of a node whose agent exports every `export_s` (at 0, export_s, ...) the
    `arrived(t)` requests counted by then, each of 100 prompt tokens: between two exports its page does not
    change."""
    now = [0.0]

    def scrape() -> dict:
        n = arrived(math.floor(now[0] / export_s) * export_s)
        return {ARRIVED: n, PROMPT_TOKENS: 100.0 * n, FIRST_TOKENS: n}

    reader = NodeExporterReader("m", endpoints=lambda: [], window_s=window_s, clock=lambda: now[0])
    reader.scrape = scrape  # type: ignore[method-assign]
    readings = []
    for t in read_times:
        now[0] = t
        readings.append(reader.read())
    return readings


def _steady(t: float) -> float:
    return 10.0 * t  # 10 req/s from t = 0


@pytest.mark.parametrize(("window_s", "tolerance"), [(30.0, 0.07), (6.0, 0.15)])
def test_a_steady_load_reads_steady_between_exports_and_reads_at_other_periods(window_s, tolerance):
    """Exports every 2 s, reads every 2.35 s: a read interval holds one export (20 requests) or two (40). The rate
    between two consecutive reads read 8.5 and 17 req/s by turns; over a window, a span of S seconds holds
    S / 2 exports, give or take one: the error is below 2 s / S (30 s: within 7%; 6 s, the controller's default
    with 2 s exports: 9.4 s spans of 4 or 5 exports, -15% and +13%)."""
    read_times = [0.1 + 2.35 * i for i in range(26)]  # ~60 s
    consecutive = [(_steady(math.floor(b / 2.0) * 2.0) - _steady(math.floor(a / 2.0) * 2.0)) / (b - a)
                   for a, b in zip(read_times, read_times[1:])]
    assert {round(rate, 1) for rate in consecutive} == {8.5, 17.0}  # what two consecutive scrapes read

    readings = _read_exports(_steady, 2.0, read_times, window_s)
    # the first scrape and the first export's: no interval yet
    assert [r.is_baseline for r in readings[:3]] == [True, True, False]
    filled = [r for r in readings if r.time_s >= 2.45 + window_s + 2.35]  # the first export was seen at 2.45 s
    assert len(filled) >= 8
    for r in filled:
        assert r.load.rate_rps == pytest.approx(10.0, rel=tolerance)
        assert r.load.mean_prompt_tokens == pytest.approx(100.0)
    assert all(r.load.rate_rps == pytest.approx(10.0, rel=0.15) for r in readings[2:])  # filling up too


def test_rays_default_export_period_read_every_5_s_reads_no_zeros_and_no_doubles():
    """Ray's default 10 s export, read every 5.3 s (5 s and the scrape's time): consecutive scrapes saw an export
    only every other read, so the rate read 0 and 2x by turns. Over the window (3 export periods), every reading
    from the second export on is within the bound (read interval / span: 5.3 / 30 here, 5.3 / 10 for the first)."""
    read_times = [0.3 + 5.3 * i for i in range(40)]  # 3.5 minutes
    consecutive = [(_steady(math.floor(b / 10.0) * 10.0) - _steady(math.floor(a / 10.0) * 10.0)) / (b - a)
                   for a, b in zip(read_times, read_times[1:])]
    assert min(consecutive) == 0.0 and max(consecutive) > 18.0

    readings = _read_exports(_steady, 10.0, read_times, 30.0)
    measured = [r for r in readings if not r.is_baseline]
    assert readings.index(measured[0]) <= 5  # from the second export that changed the counters (at 20 s)
    assert all(r.load.rate_rps == pytest.approx(10.0, rel=0.2) for r in measured)
    assert all(r.load.rate_rps == pytest.approx(10.0, rel=5.3 / 30) for r in measured if r.time_s > 45.0)


def test_a_stopped_load_reads_zero_within_a_window_and_a_returning_one_reads_again():
    """10 req/s until 40 s, none until 100 s, 10 req/s again; exports every 2 s, reads every 2.35 s, a 6 s window.
    Without a change in a whole window the rate is 0 (the last edge pair would read 10 req/s for ever); once the
    load returns, it is counted over a window from the quiet stretch's edge: back to 10 within a window."""
    def arrived(t: float) -> float:
        return 10.0 * min(t, 40.0) + 10.0 * max(0.0, t - 100.0)

    window_s = 6.0
    readings = _read_exports(arrived, 2.0, [0.1 + 2.35 * i for i in range(70)], window_s)
    by_time = {round(r.time_s, 2): r for r in readings}

    def rates(start_s: float, end_s: float) -> list[float]:
        return [r.load.rate_rps for t, r in by_time.items() if start_s <= t < end_s]

    assert all(rate == pytest.approx(10.0, rel=0.15) for rate in rates(15.0, 40.0))
    # the last change was exported at 40 s and seen by 42.4 s: the rate is 0 after a window without change
    assert all(rate == 0.0 for rate in rates(42.4 + window_s + 2.35, 100.0))
    assert not any(r.is_baseline for r in readings[2:])  # a measured 0, which the controller acts on
    assert all(rate == pytest.approx(10.0, rel=0.15) for rate in rates(102.0 + window_s + 2.35, 200.0))
    assert len(rates(102.0 + window_s + 2.35, 200.0)) >= 20


def test_a_reader_started_between_two_exports_needs_the_next_two():
    """The first scrape's values were exported up to one export period before it: counting the next export's
    2 s of requests from the first scrape (0.1 s before it was seen) read 200 req/s. The rates start from the
    first export seen to change the counters."""
    def arrived(t: float) -> float:
        return 10.0 * (t + 100.0)  # a load that began before the reader

    readings = _read_exports(arrived, 2.0, [1.9, 2.0, 3.9, 4.0], 30.0)
    assert [r.is_baseline for r in readings] == [True, True, True, False]
    assert readings[-1].load.rate_rps == pytest.approx(10.0)


def test_an_idle_model_reads_zero_after_a_window_and_the_history_stays_short():
    """Counters that never change: baseline until a window has passed without change, then a measured 0 (the
    controller decides on it: an idle application still scales down); and after hours of steady reads the
    history holds about one window of edges."""
    readings = _read_exports(lambda t: 5.0, 2.0, [0.1 + 2.35 * i for i in range(10)], 6.0)
    assert readings[2].is_baseline and not readings[3].is_baseline  # 7.15 s: more than 6 s without change
    assert all(r.load.rate_rps == 0.0 and r.attainment is None for r in readings)

    now = [0.0]
    reader = NodeExporterReader("m", endpoints=lambda: [], window_s=6.0, clock=lambda: now[0])
    for i in range(5000):  # ~3 hours at 10 req/s
        now[0] = 0.1 + 2.35 * i
        n = _steady(math.floor(now[0] / 2.0) * 2.0)
        reader.scrape = lambda n=n: {ARRIVED: n}  # type: ignore[method-assign]
        reader.read()
    assert len(reader._edges) <= 6.0 / 2.0 + 2


def _arrivals_page(by_engine: dict[str, float]) -> dict[str, str]:
    """One node's page with each engine's arrival counter (no engine: nothing exported)."""
    lines = ["# TYPE ray_bullet_requests_arrived_total counter"] + [
        f'ray_bullet_requests_arrived_total{{model_name="m",engine="{e}"}} {n}' for e, n in by_engine.items()]
    return {"node": "\n".join(lines) + "\n"} if by_engine else {}


def test_a_scrape_no_node_answered_never_becomes_the_windows_start():
    """10 req/s for 5 s, idle, and at 11 s (when the idle stretch keeps a quiet edge) no node answers; the load
    comes back at 11 s: every reading under load sees it, and from a window on reads it (a window that started at
    the empty scrape read 0 at 16 s)."""
    def arrived(t: int) -> float:
        return 10.0 * min(t, 5) + 10.0 * max(0, t - 11)

    scrapes = [{} if t == 11 else _arrivals_page({"e1": arrived(t)}) for t in range(25)]
    readings = _read_pages(scrapes, window_s=5.0)
    assert all(r.load.rate_rps > 0 for r in readings[12:])
    assert all(r.load.rate_rps == pytest.approx(10.0) for r in readings[17:])


def test_a_replica_that_starts_within_the_window_counts_from_when_it_was_first_seen():
    """e1 at 10 req/s throughout; e2 starts at 10 s and serves 5 req/s (its counter starts at 0): its arrivals count
    from its first scrape on, not only once both ends of the window hold it, and never its total as one window's."""
    def page(t: int) -> dict[str, str]:
        return _arrivals_page({"e1": 10.0 * t, **({"e2": 5.0 * (t - 10) + 1_000.0} if t >= 10 else {})})

    readings = _read_pages([page(t) for t in range(25)], window_s=5.0)
    # at 13 s: e1's 10 req/s and e2's 15 arrivals since 10 s over the 5 s window (a window that dropped e2: 10)
    assert readings[13].load.rate_rps == pytest.approx(10.0 + 15.0 / 5.0)
    assert all(r.load.rate_rps == pytest.approx(15.0) for r in readings[16:])  # e2's 1,000 at start never counted


def test_a_rising_load_reads_its_windows_middle_and_says_how_old_that_is():
    """A ramp (0.3 + 0.1 req/s each second, the integration test's) read through a 6 s window of 2 s exports: the
    rate is the one at the window's middle, `age_s` before the reading (the two edges' midpoint), so the reading
    alone trails the load by about half a window and the age says by how much."""
    def ramp(t: float) -> float:
        return 0.3 * t + 0.05 * t * t  # requests arrived by t

    read_times = [0.1 + 2.35 * i for i in range(12)]
    readings = [r for r in _read_exports(ramp, 2.0, read_times, 6.0) if not r.is_baseline]
    late = [r for r in readings if r.time_s > 12.0]
    assert late
    for r in late:
        assert 2.0 < r.age_s < 6.0  # half the 6-9 s span of edges, plus the newest edge's distance from now
        rate_then = 0.3 + 0.1 * (r.time_s - r.age_s)
        assert r.load.rate_rps == pytest.approx(rate_then, rel=0.2)
        assert r.load.rate_rps < 0.3 + 0.1 * r.time_s  # behind the load now
    baseline = _read_exports(ramp, 2.0, read_times[:1], 6.0)[0]
    assert baseline.is_baseline and baseline.age_s == 0.0
