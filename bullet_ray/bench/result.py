"""A benchmark run's records and result file (`bullet_ray.bench/1`): one `RequestRecord` per request and the
`BenchResult` that holds them with the run's config, environment and summary. Plain data: the client that
fills them is `serve_bench`, the tables and plots that read them `report`."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "bullet_ray.bench/1"


@dataclass
class RequestRecord:
    """Timings of one request. Offsets (`*_s` without 'latency') are from the start of the run."""

    index: int
    scheduled_s: float  # planned arrival
    prompt_tokens_requested: int
    output_tokens_requested: int
    send_s: float | None = None  # when it was actually sent
    queue_s: float = 0.0  # waited for a --max-concurrency slot
    ttft_s: float | None = None  # latency: send -> first chunk carrying text
    itl_s: list[float] = field(default_factory=list)  # gaps between successive text chunks
    e2e_s: float | None = None  # latency: send -> end of stream
    prompt_tokens: int | None = None  # from the usage chunk (else the requested count)
    output_tokens: int | None = None  # from the usage chunk (else the number of text chunks)
    is_usage_reported: bool = False
    num_chunks: int = 0  # SSE chunks carrying text
    num_output_chars: int = 0
    finish_reason: str | None = None
    http_status: int | None = None
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None and self.ttft_s is not None

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.e2e_s is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)  # type: ignore[operator]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "success": self.success, "tpot_s": self.tpot_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


@dataclass
class BenchResult:
    config: dict[str, Any]
    environment: dict[str, Any]
    summary: dict[str, Any]
    records: list[RequestRecord]

    @property
    def label(self) -> str:
        return self.config.get("label") or self.config.get("base_url", "?")

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "config": self.config, "environment": self.environment,
                "summary": self.summary, "requests": [r.to_dict() for r in self.records]}

    def save(self, path: str | Path) -> Path:
        return write_json_atomic(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> BenchResult:
        d = json.loads(Path(path).read_text())
        return cls(d["config"], d["environment"], d["summary"],
                   [RequestRecord.from_dict(r) for r in d["requests"]])


def write_json_atomic(path: Path, doc: Any) -> Path:
    """`doc` as indented JSON at `path`, written to a temporary file beside it and renamed into place, so a run
    stopped mid-write (a device call's time limit) leaves the old file or none, never a truncated one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)
    return path
