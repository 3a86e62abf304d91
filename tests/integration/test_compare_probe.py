"""run_comparison's per-rate probe against the fake OpenAI server of test_bench_server, given a /metrics page
that counts finished requests and steps the way vLLM's does (no vLLM, no GPU): the warm-up requests stay out
of the difference, and a probe that fails leaves the run's results whole."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from benchmarks.vllm_metrics import VllmMetricsProbe
from bullet_ray.bench.compare import RateProbe, SystemSpec, run_comparison
from tests.integration.test_bench_server import FakeServer, ServerThread, _config


class FakeVllm(FakeServer):
    """Each finished request: one prompt step of its prompt + first token, then one step per further token."""

    def __init__(self) -> None:
        super().__init__()
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.finished = Counter("vllm:request_success", "", labels + ["finished_reason"], registry=self.registry)
        self.steps = Histogram("vllm:iteration_tokens_total", "", labels, registry=self.registry,
                               buckets=[1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384])

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_get("/metrics", self._metrics)
        return app

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = await super()._generate(request)  # streams every token, then [DONE]
        steps = self.steps.labels("fake-model", "0")
        steps.observe(len(body["prompt"]) + 1)
        for _ in range(body["max_tokens"] - 1):
            steps.observe(1)
        self.finished.labels("fake-model", "0", "length").inc()
        return resp


class BrokenAfter(RateProbe):
    name = "broken"

    def start(self) -> None:
        pass

    def finish(self) -> dict[str, Any]:
        raise ValueError("no page")


def test_probe_counts_the_measured_requests_only(tmp_path: Path):
    fake = FakeVllm()
    with ServerThread(fake) as srv:
        systems = [SystemSpec("vllm", srv.url, probe=VllmMetricsProbe(f"{srv.url}/metrics", settle_s=0.1)),
                   SystemSpec("down", srv.url, probe=VllmMetricsProbe("http://127.0.0.1:9/metrics", timeout_s=2)),
                   SystemSpec("broken", srv.url, probe=BrokenAfter())]
        config = replace(_config("", num_prompts=6, random_input_tokens=20, random_output_tokens=10,
                                 random_distribution="fixed"), warmup_requests=2)
        doc = run_comparison(systems, config, tmp_path, rates=[50.0, 100.0], plot=False)
    # 3 systems x 2 rates x (2 warm-up + 6 measured) requests reached the server
    assert len(fake.bodies) == 3 * 2 * (2 + 6)
    for point in doc["systems"]["vllm"]["points"]:
        found = point["probes"]["vllm_metrics"]
        assert found["counters"]["num_requests_finished"] == 6  # not 8: the warm-up went before the first read
        # per request: one step of 20 prompt tokens + 1, nine of 1 token
        assert found["steps"]["num_steps"] == 60 and found["steps"]["num_tokens"] == 6 * (21 + 9)
        assert found["steps"]["tokens_per_step_mean"] == 3.0
        assert found["steps"]["steps_by_tokens"]["<=1"] == 54 and found["steps"]["steps_by_tokens"]["17-32"] == 6
        run = json.loads((tmp_path / point["result_file"]).read_text())
        assert run["probes"] == point["probes"] and run["config"]["warmup_requests"] == 2
        assert run["summary"]["num_completed"] == 6
    for name, phase in (("down", "start: URLError"), ("broken", "finish: ValueError: no page")):
        entry = doc["systems"][name]
        assert entry["error"] is None and len(entry["points"]) == 2
        for point in entry["points"]:
            assert point["summary"]["num_completed"] == 6
            assert point["probes"][systems[1 if name == "down" else 2].probe.name]["error"].startswith(phase)
            run = json.loads((tmp_path / point["result_file"]).read_text())
            assert run["config"]["warmup_requests"] == 2  # sent before the probe failed, or after
