"""benchmarks.vllm_metrics on a hand-written sample of vLLM's /metrics page (tests/unit/data/vllm_metrics_*.txt:
written by hand from vLLM 0.24's metric definitions, not captured from a server), and its probe over HTTP."""

from __future__ import annotations

import threading
import urllib.error
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from benchmarks.vllm_metrics import (
    COUNTERS,
    HISTOGRAMS,
    VllmMetricsProbe,
    difference,
    engine_figures,
    parse_samples,
)

DATA = Path(__file__).parent / "data"
BEFORE = (DATA / "vllm_metrics_before.txt").read_text()
AFTER = (DATA / "vllm_metrics_after.txt").read_text()
STEP_TOKEN_BOUNDS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]  # vLLM's buckets


def test_parse_keeps_vllm_samples_summed_over_labels():
    before = parse_samples(BEFORE)
    assert "http_requests_total" not in before and "python_gc_objects_collected_total" not in before
    assert before["vllm:request_success_total"] == {"": 10.0}  # stop 2 + length 8 + abort 0
    assert before["vllm:iteration_tokens_total_bucket"]["512.0"] == 38.0
    assert before["vllm:iteration_tokens_total_bucket"]["+Inf"] == 40.0
    assert before["vllm:iteration_tokens_total_sum"] == {"": 3000.0}
    assert before["vllm:num_requests_running"] == {"": 0.0}


def test_difference_and_figures_of_one_rate():
    delta = difference(parse_samples(BEFORE), parse_samples(AFTER), HISTOGRAMS + tuple(COUNTERS.values()))
    assert "vllm:num_requests_running" not in delta and "vllm:iteration_tokens_total_created" not in delta
    assert delta["vllm:iteration_tokens_total_bucket"]["32.0"] == 70.0  # cumulative, as exposed
    figures = engine_figures(delta)
    assert figures["steps"] == {
        "num_steps": 100, "num_tokens": 12000, "tokens_per_step_mean": 120.0,
        "steps_by_tokens": {"<=1": 0, "2-8": 0, "9-16": 20, "17-32": 50, "33-64": 10, "65-128": 0, "129-256": 0,
                            "257-512": 5, "513-1024": 10, "1025-2048": 5, "2049-4096": 0, "4097-8192": 0,
                            "8193-16384": 0, "16385+": 0}}
    assert figures["counters"] == {"num_preemptions": 2, "prompt_tokens": 7000, "generation_tokens": 5000,
                                   "num_requests_finished": 40}
    t = figures["time_ms"]
    assert (t["queue"]["count"], t["queue"]["mean_ms"]) == (40, 50.0)
    assert t["prefill"]["mean_ms"] == 100.0 and t["decode"]["mean_ms"] == 2000.0 and t["e2e"]["mean_ms"] == 2500.0
    assert t["ttft"]["mean_ms"] == 150.0
    assert (t["itl"]["metric"], t["itl"]["count"], t["itl"]["mean_ms"]) == \
        ("vllm:inter_token_latency_seconds", 4960, 25.0)
    assert t["inference"] is None and figures["missing"] == ["vllm:request_inference_time_seconds"]


def test_the_sample_reads_like_prometheus_clients_own_exposition():
    """The hand-written page's sample names and bucket bounds are what prometheus_client writes for
    vLLM's metric definitions (a counter gains _total, a histogram named ..._total keeps it)."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    Counter("vllm:num_preemptions", "", labels, registry=registry).labels("m", "0").inc(3)
    Histogram("vllm:iteration_tokens_total", "", labels, buckets=STEP_TOKEN_BOUNDS,
              registry=registry).labels("m", "0").observe(20)
    made = parse_samples(generate_latest(registry).decode())
    written = parse_samples(BEFORE)
    for name in ("vllm:num_preemptions_total", "vllm:iteration_tokens_total_bucket",
                 "vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total_sum"):
        assert made[name].keys() == written[name].keys()
    assert made["vllm:iteration_tokens_total_bucket"]["32.0"] == 1.0


def test_older_itl_name_and_absent_metrics():
    page = """# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="0.05"} 30.0
vllm:time_per_output_token_seconds_bucket{le="+Inf"} 40.0
vllm:time_per_output_token_seconds_count 40.0
vllm:time_per_output_token_seconds_sum 1.2
"""
    delta = difference({}, parse_samples(page), HISTOGRAMS)
    figures = engine_figures(delta)
    assert figures["time_ms"]["itl"] == {"metric": "vllm:time_per_output_token_seconds", "count": 40,
                                         "mean_ms": 30.0}
    assert figures["steps"] is None and figures["counters"]["num_preemptions"] is None
    assert "vllm:iteration_tokens_total" in figures["missing"] and "vllm:num_preemptions_total" in figures["missing"]
    assert "vllm:inter_token_latency_seconds" not in figures["missing"]


def test_a_step_histogram_without_its_sum_keeps_its_counts():
    page = """# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{le="1.0"} 3.0
vllm:iteration_tokens_total_bucket{le="+Inf"} 5.0
vllm:iteration_tokens_total_count 5.0
"""
    steps = engine_figures(difference({}, parse_samples(page), HISTOGRAMS))["steps"]
    assert steps["num_steps"] == 5 and steps["num_tokens"] is None and steps["tokens_per_step_mean"] is None
    assert steps["steps_by_tokens"]["<=1"] == 3


class _Pages(BaseHTTPRequestHandler):
    pages: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = self.pages.pop(0).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_probe_reads_the_page_before_and_after():
    _Pages.pages = [BEFORE, AFTER]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Pages)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        probe = VllmMetricsProbe(url, settle_s=0.0)
        with pytest.raises(RuntimeError, match="without a successful start"):
            probe.finish()
        probe.start()
        found = probe.finish()
    finally:
        server.shutdown()
        server.server_close()
    assert found["url"] == url and found["steps"]["num_steps"] == 100
    assert found["counters"]["num_requests_finished"] == 40
    assert found["delta"]["vllm:iteration_tokens_total_sum"] == {"": 12000.0}


def test_probe_of_a_closed_port_raises():
    probe = VllmMetricsProbe("http://127.0.0.1:9/metrics", timeout_s=2.0)
    with pytest.raises(urllib.error.URLError):
        probe.start()
