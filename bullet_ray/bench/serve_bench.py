"""Load generator for OpenAI-compatible LLM servers (this project's, vLLM's, SGLang's): `run_benchmark`.

Sends a workload (bullet_ray/bench/traces.py) at its arrival times as streaming /v1/completions or
/v1/chat/completions requests (`stream_options.include_usage`, `ignore_eos` + `max_tokens` to force output
lengths) and records per request: send time, TTFT, the gap between successive SSE chunks that carry text
(a chunk may carry several tokens, so these are per-chunk inter-token latencies), e2e latency, token
counts from the usage chunk, and the HTTP status/body or exception of a failed request. TPOT =
(e2e - TTFT) / (output_tokens - 1). Latencies are measured from the moment a request is sent; with
--max-concurrency the wait for a slot is recorded separately (queue_s) and not part of TTFT.

    python -m bullet_ray.bench.serve_bench --base-url http://127.0.0.1:8000 --dataset azure-conv --rate 4
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import platform
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from bullet_ray.bench import require_extra
from bullet_ray.bench.result import BenchResult, RequestRecord
from bullet_ray.bench.slo import SLO, parse_slo, summarize
from bullet_ray.bench.traces import (
    RequestSpec,
    WorkloadConfig,
    add_workload_arguments,
    build_workload,
    workload_from_args,
)

if TYPE_CHECKING:
    import aiohttp

logger = logging.getLogger(__name__)


class SSEParser:
    """Incremental Server-Sent-Events parser: feed bytes as they arrive, get each event's data payload."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events: list[str] = []
        while True:
            newline = self._buffer.find(b"\n")
            if newline < 0:
                return events
            line = self._buffer[:newline].rstrip(b"\r").decode("utf-8")
            self._buffer = self._buffer[newline + 1:]
            if not line:  # blank line ends an event
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[5:].removeprefix(" "))
            # comments (":"), "event:", "id:", "retry:" carry nothing a benchmark needs

    def flush(self) -> list[str]:
        """The last event of a stream that ended without a blank line."""
        events = self.feed(b"\n\n") if self._buffer or self._data else []
        return events


@dataclass
class BenchConfig:
    """One run: where, what, how. `slos[0]` is the primary SLO (the one goodput uses)."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: Literal["completions", "chat"] = "completions"
    model: str | None = None  # None: the first model GET /v1/models lists
    api_key: str | None = None
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    slos: list[str] = field(default_factory=lambda: ["relaxed"])
    max_concurrency: int | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_timeout_s: float = 600.0
    warmup_requests: int = 0
    is_progress_shown: bool = True
    label: str | None = None  # the system's name in tables and plots

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("api_key")  # never written to result files
        return d


# ---------------------------------------------------------------- the client

def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def fetch_model(session: aiohttp.ClientSession, base_url: str, api_key: str | None = None) -> str:
    """The id of the first model the server lists at /v1/models."""
    async with session.get(f"{base_url.rstrip('/')}/v1/models", headers=_headers(api_key)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET {base_url}/v1/models: HTTP {resp.status} {(await resp.text())[:500]}; "
                               f"pass --model")
        models = (await resp.json()).get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


def request_body(config: BenchConfig, model: str, spec: RequestSpec) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": spec.output_tokens, "temperature": config.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.endpoint == "chat":
        if not isinstance(spec.prompt, str):
            raise ValueError("the chat endpoint takes text prompts: use --prompt-mode text with --tokenizer")
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    body.update(config.extra_body)
    return body


def _chunk_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")


async def send_request(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                       body: dict[str, Any], record: RequestRecord, t0: float) -> RequestRecord:
    """Send one streaming request and fill `record`; never raises (errors go into record.error)."""
    start = time.perf_counter()
    record.send_s = start - t0
    last_text_at: float | None = None
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            record.http_status = resp.status
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:2000]}"
                return record
            parser = SSEParser()
            async for raw in resp.content.iter_any():
                now = time.perf_counter()
                for payload in parser.feed(raw):
                    last_text_at = _handle_event(payload, record, now, start, last_text_at)
            for payload in parser.flush():
                last_text_at = _handle_event(payload, record, time.perf_counter(), start, last_text_at)
    except asyncio.CancelledError:
        record.error = "cancelled"
        raise
    except Exception as e:  # connection refused, reset, timeout, bad JSON: all recorded, none lost
        record.error = f"{type(e).__name__}: {e}"
    finally:
        record.e2e_s = time.perf_counter() - start
    if record.error is None and record.ttft_s is None:
        if record.output_tokens:  # tokens that decode to no text (e.g. partial UTF-8)
            record.ttft_s = record.e2e_s
        else:
            record.error = "stream ended without any generated text"
    if record.prompt_tokens is None:
        record.prompt_tokens = record.prompt_tokens_requested
    if record.output_tokens is None:
        record.output_tokens = record.num_chunks
    return record


def _handle_event(payload: str, record: RequestRecord, now: float, start: float,
                  last_text_at: float | None) -> float | None:
    if payload.strip() == "[DONE]":
        return last_text_at
    obj = json.loads(payload)
    if obj.get("error") or obj.get("object") == "error":
        err = obj.get("error", obj)
        record.error = f"stream error: {json.dumps(err)[:2000]}"
        return last_text_at
    usage = obj.get("usage")
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.output_tokens = usage.get("completion_tokens")
        record.is_usage_reported = True
    for choice in obj.get("choices") or []:
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
        text = _chunk_text(choice)
        if not text:
            continue
        if record.ttft_s is None:
            record.ttft_s = now - start
        elif last_text_at is not None:
            record.itl_s.append(now - last_text_at)
        last_text_at = now
        record.num_chunks += 1
        record.num_output_chars += len(text)
    return last_text_at


# ---------------------------------------------------------------- a run

async def _warm_up(session: aiohttp.ClientSession, url: str, headers: dict[str, str], config: BenchConfig,
                   model: str) -> None:
    """Send `warmup_requests` requests of the workload's kind, one at a time, with other prompts (another
    seed) so a prefix cache does not favour the measured ones."""
    if config.warmup_requests <= 0:
        return
    warm_cfg = replace(config.workload, seed=config.workload.seed + 10007, num_prompts=config.warmup_requests,
                       rate_rps=None, trace_scale=None, duration_s=None)
    for spec in build_workload(warm_cfg):
        record = RequestRecord(-1, 0.0, spec.prompt_tokens, spec.output_tokens)
        await send_request(session, url, headers, request_body(config, model, spec), record, time.perf_counter())
        if record.error:
            logger.warning("warm-up request failed: %s", record.error)


def redact_argv(argv: list[str]) -> list[str]:
    """argv with the value of --api-key replaced, so result files never hold a key."""
    out, hide_next = [], False
    for arg in argv:
        if hide_next:
            out.append("<redacted>")
        elif arg.startswith("--api-key="):
            out.append("--api-key=<redacted>")
        else:
            out.append(arg)
        hide_next = arg == "--api-key"
    return out


PACKAGE_DIR = Path(__file__).resolve().parents[1]  # bullet_ray/


def source_digest(root: Path | None = None) -> str:
    """sha256 (first 16 hex digits) over the package's Python sources, path and content, in path order.

    Names the code a run used where git cannot: a copied working tree (the GPU machine gets one) keeps
    the .git of an older commit, so `git rev-parse HEAD` there answers that commit. Compare with
    `python -c "from bullet_ray.bench.serve_bench import source_digest; print(source_digest())"` here."""
    root = root or PACKAGE_DIR
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True,
                              timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def environment(config: BenchConfig, model: str, started_unix_s: float | None = None) -> dict[str, Any]:
    commit = _git("rev-parse", "HEAD") or None
    status = _git("status", "--porcelain", "--untracked-files=no", "--", str(PACKAGE_DIR))
    return {"host": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
            "aiohttp": require_extra("aiohttp").__version__, "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command_line": redact_argv(sys.argv), "bench_git_commit": commit,
            # the package differs from that commit (None: no git); the digest names the code either way
            "bench_git_dirty": bool(status) if status is not None and commit else None,
            "bench_source_digest": source_digest(), "server_url": config.base_url, "model": model,
            # wall-clock time of the first request's schedule (scheduled_s = 0): lines runs up with step logs
            "started_unix_s": round(started_unix_s, 6) if started_unix_s is not None else None}


async def run_benchmark(config: BenchConfig, requests: list[RequestSpec] | None = None) -> BenchResult:
    """Run one workload against one server and return every request's timings and the summary."""
    from tqdm.auto import tqdm

    aiohttp = require_extra("aiohttp")
    slos: list[SLO] = [parse_slo(s) for s in config.slos]
    if requests is None:
        requests = build_workload(config.workload)
    base = config.base_url.rstrip("/")
    url = f"{base}/v1/chat/completions" if config.endpoint == "chat" else f"{base}/v1/completions"
    headers = _headers(config.api_key)
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or 0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
        model = config.model or await fetch_model(session, base, config.api_key)
        bodies = [request_body(config, model, spec) for spec in requests]
        await _warm_up(session, url, headers, config, model)
        limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        bar = tqdm(total=len(requests), desc=config.label or "requests", unit="req",
                   disable=not config.is_progress_shown)

        async def one(spec: RequestSpec, body: dict[str, Any], t0: float) -> RequestRecord:
            record = RequestRecord(spec.index, spec.arrival_s, spec.prompt_tokens, spec.output_tokens)
            if limit is None:
                await send_request(session, url, headers, body, record, t0)
            else:
                async with limit:
                    record.queue_s = time.perf_counter() - t0 - spec.arrival_s
                    await send_request(session, url, headers, body, record, t0)
            bar.update(1)
            return record

        t0, started_unix_s = time.perf_counter(), time.time()
        tasks = []
        for spec, body in zip(requests, bodies):
            delay = t0 + spec.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec, body, t0)))
        records = list(await asyncio.gather(*tasks))
        bar.close()
    ends = [r.send_s + r.e2e_s for r in records if r.send_s is not None and r.e2e_s is not None]
    duration_s = max(ends) if ends else 0.0
    env = environment(config, model, started_unix_s)
    cfg = {**config.to_dict(), "model": model, "url": url}
    return BenchResult(cfg, env, summarize(records, duration_s, slos), records)


# ---------------------------------------------------------------- command line

def add_arguments(parser: argparse.ArgumentParser, is_sweep: bool = False) -> None:
    """The flags of one run (shared by `bullet-ray bench` and bullet_ray.bench.compare, which sweeps rates over
    several systems: is_sweep=True leaves out --base-url, --rate and --trace-scale)."""
    s = parser.add_argument_group("server")
    if not is_sweep:
        s.add_argument("--base-url", default="http://127.0.0.1:8000",
                       help="server root, without /v1 (default http://127.0.0.1:8000)")
    s.add_argument("--endpoint-kind", dest="endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions (default; takes token-id prompts) or /v1/chat/completions (text only)")
    s.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    s.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (never saved)")
    s.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos=true (servers that reject it; output lengths are then not forced)")
    s.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    s.add_argument("--extra-body", default="{}", help="JSON object merged into every request body")
    s.add_argument("--request-timeout-s", type=float, default=600.0, help="per-request limit (default 600)")
    s.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight; later ones wait (wait not counted in TTFT)")
    s.add_argument("--warmup-requests", type=int, default=0, help="send this many first, one at a time, unrecorded")
    add_workload_arguments(parser, with_rate=not is_sweep)
    o = parser.add_argument_group("output")
    o.add_argument("--slo", action="append", default=None,
                   help="SLO to score (repeatable, first = primary): relaxed (default), strict, bullet-sharegpt, "
                        "bullet-azure-code, bullet-arxiv, or 'ttft_ms=800,tpot_ms=40' / "
                        "'ttft_ms_per_token=2,tpot_ms=100'")
    o.add_argument("--output-dir", default="benchmarks/results/serve", help="where JSON/markdown/PNG go")
    o.add_argument("--label", default=None, help="name of the system in tables/plots and the file name")
    o.add_argument("--no-plot", dest="plot", action="store_false", help="skip the PNG plots")
    o.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(base_url=getattr(args, "base_url", ""), endpoint=args.endpoint, model=args.model, api_key=args.api_key,
                       workload=workload_from_args(args), slos=args.slo or ["relaxed"],
                       max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
                       temperature=args.temperature, extra_body=json.loads(args.extra_body),
                       request_timeout_s=args.request_timeout_s, warmup_requests=args.warmup_requests,
                       is_progress_shown=args.progress, label=args.label)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bullet_ray.bench.serve_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    from bullet_ray.bench import report

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)
    result = asyncio.run(run_benchmark(config))
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    name = f"{config.label or 'run'}-{config.workload.dataset}-{stamp}"
    out = Path(args.output_dir)
    path = result.save(out / f"{name}.json")
    table = report.summary_markdown([result])
    (out / f"{name}.md").write_text(table + "\n")
    print(table)
    if args.plot:
        report.plot_latency_cdfs([result], out / f"{name}-cdf.png")
    print(f"results: {path}")
    return 0 if result.summary["num_completed"] else 1


def main(argv: list[str] | None = None) -> int:
    return run_from_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
