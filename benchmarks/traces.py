"""Workloads for the serving benchmark: arrival times and (prompt, output) lengths, seeded and repeatable.

Sources: the Azure LLM inference 2023 traces (conversation and code: TIMESTAMP, ContextTokens,
GeneratedTokens), ShareGPT-format JSON (lengths counted with a tokenizer), or random lengths. Arrivals:
Poisson at a rate, or the trace's own timestamps scaled by a factor.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import os
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    arrival_s: float  # seconds after the start of the run
    prompt_tokens: int
    output_tokens: int


def default_trace_dir() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(here, "..", "..", "shared", "data", "azure-llm-inference-2023")


def read_azure(kind: str, trace_dir: str | None = None) -> list[tuple[float, int, int]]:
    """(seconds since the first request, prompt tokens, output tokens) of the conv or code trace."""
    path = os.path.join(trace_dir or default_trace_dir(), f"{kind}.csv")
    rows = []
    with open(path) as f:
        for row in csv.DictReader(f):
            stamp = dt.datetime.fromisoformat(row["TIMESTAMP"][:26])
            rows.append((stamp, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    t0 = rows[0][0]
    return [((t - t0).total_seconds(), p, o) for t, p, o in rows]


def read_sharegpt(path: str, tokenizer) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of the first human/gpt turn pair of each conversation."""
    with open(path) as f:
        data = json.load(f)
    pairs = []
    for conv in data:
        turns = conv.get("conversations", [])
        if len(turns) >= 2:
            pairs.append((len(tokenizer.encode(turns[0]["value"])), len(tokenizer.encode(turns[1]["value"]))))
    return pairs


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def build_workload(dataset: str, num_requests: int, seed: int, rate: float | None = None,
                   trace_scale: float | None = None, max_prompt_tokens: int = 4096, max_output_tokens: int = 1024,
                   random_prompt: tuple[int, int] = (32, 512), random_output: tuple[int, int] = (16, 256),
                   trace_dir: str | None = None, sharegpt_pairs: list[tuple[int, int]] | None = None) -> list[Request]:
    """A seeded workload: the same arguments give the same arrivals and lengths."""
    rng = random.Random(seed)
    if dataset in ("azure-conv", "azure-code"):
        rows = read_azure(dataset.split("-")[1], trace_dir)
        if trace_scale is not None:  # replay the trace's timestamps, compressed or stretched
            rows = rows[:num_requests]
            times = [t / trace_scale for t, _, _ in rows]
            lengths = [(p, o) for _, p, o in rows]
        else:
            lengths = [(p, o) for _, p, o in rng.sample(rows, min(num_requests, len(rows)))]
            times = []
    elif dataset == "sharegpt":
        assert sharegpt_pairs is not None, "sharegpt needs sharegpt_pairs (read_sharegpt)"
        lengths = [rng.choice(sharegpt_pairs) for _ in range(num_requests)]
        times = []
    elif dataset == "random":
        lengths = [(rng.randint(*random_prompt), rng.randint(*random_output)) for _ in range(num_requests)]
        times = []
    else:
        raise ValueError(f"unknown dataset {dataset!r}; choose azure-conv, azure-code, sharegpt or random")
    if not times:
        if rate is None:
            raise ValueError("give --rate (Poisson arrivals) or --trace-scale (trace timestamps)")
        times = poisson_arrivals(rate, len(lengths), seed)
    return [Request(t, max(1, min(p, max_prompt_tokens)), max(1, min(o, max_output_tokens)))
            for t, (p, o) in zip(times, lengths)]
