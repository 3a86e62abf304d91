"""The node-exporter reader on canned exposition text (no Ray, no server) and the quantile helper."""

from __future__ import annotations

import http.server
import threading

import pytest

from bullet_ray.control.readings import NodeExporterReader, histogram_quantile


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
    pages = [exposition(10, 5, 10), exposition(30, 10, 30, prompt_tokens=100.0 if lagging_tokens else None)]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = pages[0].encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        reader = NodeExporterReader("m", endpoints=lambda: [url])
        first = reader.read()
        assert first.is_baseline and first.load.rate_rps == 0.0  # one scrape: no rate yet (the controller skips it)
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
    finally:
        server.shutdown()


def test_a_node_that_missed_a_scrape_counts_no_lifetime_total_as_one_interval():
    """Scrapes: both nodes, then node b fails, then both again: b's counter counts only from where both
    scrapes saw it, not its whole total as one interval's arrivals (which decided the GPU budget at once)."""
    def page(arrived: float, engine: str) -> str:
        return (f'# TYPE ray_bullet_requests_arrived_total counter\n'
                f'ray_bullet_requests_arrived_total{{model_name="m",engine="{engine}"}} {arrived}\n')

    scrapes = [{"a": page(100, "a"), "b": page(1_000_000, "b")}, {"a": page(110, "a")},
               {"a": page(120, "a"), "b": page(1_000_020, "b")}]
    reader = NodeExporterReader("m", endpoints=lambda: [])
    readings = []
    for pages in scrapes:
        reader.scrape = lambda pages=pages: _parsed(pages)  # type: ignore[method-assign]
        readings.append(reader.read())
    assert readings[0].is_baseline
    arrivals = [r.load.rate_rps * (r.time_s - before.time_s) for before, r in zip(readings, readings[1:])]
    # a's 10 each time; b only where both scrapes saw it (not in the third: the second lacked it), never its million
    assert arrivals == [pytest.approx(10.0), pytest.approx(10.0)]


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
