"""The load generator against a fake OpenAI-compatible streaming server (no model, no Ray).

The fake server streams `max_tokens` tokens, `tokens_per_chunk` per SSE chunk, then a usage chunk; it can fail
every k-th request with HTTP 500 or break a stream with an in-stream error. Run as a script it serves on a port
(`python tests/integration/test_bench_server.py --port N`), which the comparison runner's --launch test uses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import socket
import sys
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from aiohttp import web

FAKE_MODEL = "fake-model"


@dataclass
class FakeServer:
    tokens_per_chunk: int = 1
    token_delay_s: float = 0.001
    fail_every: int = 0  # every k-th request (1-based count) answers HTTP 500
    break_every: int = 0  # every k-th request sends 2 chunks then an error event
    is_usage_sent: bool = True
    bodies: list[dict] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        return app

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": FAKE_MODEL, "object": "model"}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        count = len(self.bodies)
        if self.fail_every and count % self.fail_every == 0:
            return web.json_response({"error": {"message": f"fake failure {count}"}}, status=500)
        is_chat = request.path.endswith("chat/completions")
        prompt = body["messages"][0]["content"] if is_chat else body["prompt"]
        num_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        num_out = body["max_tokens"] if body.get("ignore_eos") else min(3, body["max_tokens"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        sent = 0
        while sent < num_out:
            k = min(self.tokens_per_chunk, num_out - sent)
            await asyncio.sleep(self.token_delay_s * k)
            sent += k
            finish = "length" if sent == num_out else None
            choice = {"index": 0, "delta": {"content": " tok" * k}} if is_chat else {"index": 0, "text": " tok" * k}
            await resp.write(f"data: {json.dumps({'choices': [{**choice, 'finish_reason': finish}]})}\n\n".encode())
            if self.break_every and count % self.break_every == 0 and sent >= 2:
                await resp.write(b'data: {"error": {"message": "engine died", "code": 500}}\n\n')
                return resp
        if self.is_usage_sent and body.get("stream_options", {}).get("include_usage"):
            usage = {"prompt_tokens": num_prompt, "completion_tokens": num_out, "total_tokens": num_prompt + num_out}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """The fake server on 127.0.0.1:<free port> in a thread with its own event loop."""

    def __init__(self, server: FakeServer) -> None:
        self.server, self.port = server, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._runner = web.AppRunner(self.server.app())
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())

    def __enter__(self) -> ServerThread:
        self._thread.start()
        assert self._started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def _config(url: str, **workload):
    from bullet_ray.bench.serve_bench import BenchConfig
    from bullet_ray.bench.traces import WorkloadConfig

    w = WorkloadConfig(**{"dataset": "random", "num_prompts": 12, "rate_rps": 200.0, "random_input_tokens": 20,
                          "random_output_tokens": 10, "seed": 3, **workload})
    return BenchConfig(base_url=url, workload=w, slos=["relaxed", "strict"], is_progress_shown=False)


def test_token_counts_match_usage_and_lengths_are_forced():
    from bullet_ray.bench.serve_bench import run_benchmark
    from bullet_ray.bench.traces import build_workload

    fake = FakeServer(tokens_per_chunk=3)
    with ServerThread(fake) as srv:
        config = _config(srv.url)
        result = asyncio.run(run_benchmark(config))
    specs = build_workload(config.workload)
    assert len(result.records) == len(specs) == 12
    for rec, spec in zip(result.records, specs):
        assert rec.success, rec.error
        assert rec.is_usage_reported
        assert rec.output_tokens == rec.output_tokens_requested == spec.output_tokens
        assert rec.prompt_tokens == rec.prompt_tokens_requested == spec.prompt_tokens
        assert rec.num_chunks == math.ceil(spec.output_tokens / 3)
        assert len(rec.itl_s) == rec.num_chunks - 1
        assert rec.num_output_chars == 4 * spec.output_tokens
        assert rec.finish_reason == "length"
        assert rec.tpot_s is not None and rec.e2e_s >= rec.ttft_s
    # what was sent: the model from /v1/models, forced lengths, id prompts of the exact length
    sent = {tuple(b["prompt"]): b for b in fake.bodies}
    for spec in specs:
        body = sent[tuple(spec.prompt)]
        assert body["model"] == FAKE_MODEL and body["ignore_eos"] is True and body["stream"] is True
        assert body["max_tokens"] == spec.output_tokens and len(body["prompt"]) == spec.prompt_tokens
        assert body["stream_options"] == {"include_usage": True}
    s = result.summary
    assert s["num_completed"] == 12 and s["num_failed"] == 0 and s["num_output_length_mismatch"] == 0
    assert s["total_output_tokens"] == sum(sp.output_tokens for sp in specs)
    assert set(s["slo"]) == {"relaxed", "strict"}
    assert result.config["model"] == FAKE_MODEL and result.environment["server_url"] == srv.url


def test_errors_are_recorded_not_lost():
    from bullet_ray.bench.serve_bench import run_benchmark

    fake = FakeServer(fail_every=4, break_every=5)
    with ServerThread(fake) as srv:
        result = asyncio.run(run_benchmark(_config(srv.url, num_prompts=20, random_output_tokens=6,
                                                   random_distribution="fixed")))
    assert len(result.records) == 20
    http_failed = [r for r in result.records if r.http_status == 500]
    broken = [r for r in result.records if r.error and r.error.startswith("stream error")]
    # arrival order is not server order, so count: 20 requests -> 5 HTTP 500 (4, 8, ..., 20) and
    # 3 broken streams (5, 10, 15; the 20th failed before streaming)
    assert len(http_failed) == 5 and all("fake failure" in r.error for r in http_failed)
    assert len(broken) == 3 and all("engine died" in r.error for r in broken)
    s = result.summary
    assert s["num_failed"] == 8 and s["num_completed"] == 12
    assert s["slo"]["relaxed"]["attainment"] <= 12 / 20  # failures are misses


def test_server_down_gives_error_records():
    from bullet_ray.bench.serve_bench import run_benchmark

    config = replace(_config(f"http://127.0.0.1:{free_port()}", num_prompts=3), model="m")
    result = asyncio.run(run_benchmark(config))
    assert [r.success for r in result.records] == [False] * 3
    assert all("Connect" in r.error for r in result.records)
    assert result.summary["slo"]["relaxed"]["attainment"] == 0.0


def test_chat_endpoint_text_prompts_and_missing_usage():
    from bullet_ray.bench.serve_bench import run_benchmark
    from bullet_ray.bench.traces import RequestSpec

    fake = FakeServer(is_usage_sent=False)
    specs = [RequestSpec(i, 0.0, 3, 4 + i, "hello big world") for i in range(3)]
    with ServerThread(fake) as srv:
        config = replace(_config(srv.url), endpoint="chat")
        result = asyncio.run(run_benchmark(config, specs))
    assert all(b["messages"] == [{"role": "user", "content": "hello big world"}] for b in fake.bodies)
    for rec in result.records:
        assert rec.success and not rec.is_usage_reported
        assert rec.output_tokens == rec.num_chunks == rec.output_tokens_requested  # one token per chunk


def test_cli_writes_json_table_and_plot(tmp_path: Path):
    from bullet_ray.bench import serve_bench

    with ServerThread(FakeServer()) as srv:
        rc = serve_bench.main(["--base-url", srv.url, "--num-prompts", "5", "--rate", "100",
                               "--random-output-tokens", "4", "--output-dir", str(tmp_path), "--label", "fake",
                               "--no-progress", "--slo", "strict"])
    assert rc == 0
    (json_path,) = tmp_path.glob("fake-random-*.json")
    doc = json.loads(json_path.read_text())
    assert doc["schema"] == "bullet_ray.bench/1" and len(doc["requests"]) == 5
    assert doc["summary"]["slo"]["strict"]["description"].startswith("strict: TTFT <= 500 ms")
    assert "api_key" not in doc["config"]
    assert list(tmp_path.glob("fake-random-*-cdf.png")) and list(tmp_path.glob("fake-random-*.md"))


@pytest.mark.slow
def test_compare_two_systems_one_launched(tmp_path: Path):
    from bullet_ray.bench.compare import SystemSpec, run_comparison

    port = free_port()
    launch = f"{sys.executable} {Path(__file__).resolve()} --port {port}"
    with ServerThread(FakeServer()) as srv:
        systems = [SystemSpec("running", srv.url),
                   SystemSpec("launched", f"http://127.0.0.1:{port}", launch=launch, ready_timeout_s=60)]
        doc = run_comparison(systems, _config("", num_prompts=6), tmp_path, rates=[50.0, 100.0])
    for name in ("running", "launched"):
        entry = doc["systems"][name]
        assert entry["error"] is None
        assert [p["rate_rps"] for p in entry["points"]] == [50.0, 100.0]
        assert all(p["summary"]["num_completed"] == 6 for p in entry["points"])
        assert entry["goodput"]["relaxed"]["measured_rps"] in (0.0, 50.0, 100.0)
    assert (tmp_path / "compare.md").is_file() and (tmp_path / "compare.png").is_file()
    assert len(list((tmp_path / "runs").glob("*.json"))) == 4
    with socket.socket() as s:  # the launched server was stopped
        assert s.connect_ex(("127.0.0.1", port)) != 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="fake OpenAI-compatible streaming server")
    parser.add_argument("--port", type=int, required=True)
    web.run_app(FakeServer().app(), host="127.0.0.1", port=parser.parse_args().port, print=None)
