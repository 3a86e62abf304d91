"""A GPU engine run with a step log, shared by the GPU tests that compare two configurations' tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def run_logged(log: Path, prompts: list[list[int]], max_tokens: int, **config: Any) -> tuple[list, list, Any]:
    """(greedy tokens per prompt, the step log's records, the engine's stats after the run) of dummy
    SmolLM2-135M on the GPU (1 GiB of KV, 16 sequences) with `config`'s EngineConfig fields; every KV block
    must come back."""
    from bullet_ray.config import EngineConfig
    from bullet_ray.engine.llm_engine import LLMEngine
    from bullet_ray.engine.sampling_params import SamplingParams

    engine_config = EngineConfig(model="dummy:smollm2-135m", device="cuda", kv_cache_memory_gb=1.0, max_num_seqs=16,
                                 step_log_path=str(log), **config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLMEngine(engine_config) as engine:
        tokens = [o.token_ids for o in engine.generate(prompts, params)]
        stats = engine.stats()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
    return tokens, [json.loads(line) for line in log.read_text().splitlines()], stats
