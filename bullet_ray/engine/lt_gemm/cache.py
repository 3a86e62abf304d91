"""The cache of `engine.prefill_gemm: cublaslt`'s choices: a JSON file of every tuned point's choice, keyed by what
it depends on, so that a later start times only what is new and runs the same algorithms as the last."""

from __future__ import annotations

import fcntl
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bullet_ray.engine.lt_gemm.router import ALGO_BYTES, Choice

logger = logging.getLogger(__name__)

CACHE_VERSION = 1  # raise with any change to how a point is chosen (candidates, MARGIN, MAX_REL_ERR, timing)


def cache_key(prefix: str, sms: int, n: int, k: int, tokens: int) -> str:
    return f"{prefix}|sms {sms}|{n}x{k}|{tokens} rows"


def choice_to_dict(choice: Choice) -> dict[str, Any]:
    return {**asdict(choice), "algo": None if choice.algo is None else choice.algo.hex()}


def cached_choice(row: Any) -> Choice | None:
    """A cache row as a Choice; None when there is none or it is not one (a damaged row is timed again)."""
    if row is None:
        return None
    try:
        return choice_from_dict(row)
    except (KeyError, TypeError, ValueError):
        return None


def choice_from_dict(row: dict[str, Any]) -> Choice:
    fields = {k: row[k] for k in ("tokens", "sm_target", "ms", "base_ms", "label", "source", "candidates")}
    algo = None if row["algo"] is None else bytes.fromhex(row["algo"])
    if algo is not None and len(algo) != ALGO_BYTES:
        raise ValueError(f"an algorithm is {ALGO_BYTES} bytes, the row has {len(algo)}")
    return Choice(algo=algo, **fields)


def cache_path() -> Path | None:
    """The choices' cache: BULLET_RAY_LT_GEMM_CACHE (a JSON file; "off": none), else
    ~/.cache/bullet_ray/lt_gemm.json. A later start on the same device, cuBLASLt and mode times only what is new (and
    runs the same algorithms: serving runs compared with each other do not differ by their tuning's noise)."""
    value = os.environ.get("BULLET_RAY_LT_GEMM_CACHE", "")
    if value.lower() in ("off", "0"):
        return None
    if value:
        return Path(value)
    try:
        return Path.home() / ".cache" / "bullet_ray" / "lt_gemm.json"
    except RuntimeError:  # no home to resolve: no cache
        return None


def load_cache(path: Path | None) -> dict[str, dict[str, Any]]:
    """The cached choices at `path` ({} when there is none or it cannot be read: it is only a cache)."""
    if path is None:
        return {}
    try:
        if not path.exists():
            return {}
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError) as e:
        logger.warning("the cuBLASLt choices' cache %s was not read (%s): tuning afresh", path, e)
        return {}


def save_cache(path: Path | None, cache: dict[str, dict[str, Any]]) -> None:
    """Write the cache over what the file holds now (another engine on the node may have added to it since this one
    read it), atomically; a failure is logged, never raised."""
    if path is None:
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(f"{path.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # read, merge and replace as one: engines on a node start together
            tmp.write_text(json.dumps({**load_cache(path), **cache}, indent=0, sort_keys=True))
            os.replace(tmp, path)
    except OSError as e:
        logger.warning("the cuBLASLt choices' cache %s was not written: %s", path, e)
        tmp.unlink(missing_ok=True)
