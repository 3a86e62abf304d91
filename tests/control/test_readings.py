"""The node-exporter reader on canned exposition text (no Ray, no server, no sleeps: the reader's clock is
injected) and the quantile helper."""

from __future__ import annotations

import threading

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

