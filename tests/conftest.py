"""Test-session settings shared by every test: GPU tests skip without CUDA; a per-session model cache."""

from __future__ import annotations

import os

import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# tests run with the model cache of the user (the dequantized embedded model is reused across runs)
os.environ.setdefault("BULLET_RAY_LOG_LEVEL", "WARNING")


def _hf_greedy(model, prompt_ids: list[int], num_new: int) -> list[int]:
    """Greedy decoding with a transformers model and its own KV cache, never stopping at EOS
    (`generate(min_new_tokens=...)` would mask EOS instead, which is not what ignore_eos means)."""
    import torch

    out: list[int] = []
    with torch.no_grad():
        result = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(num_new):
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            result = model(torch.tensor([[token]]), past_key_values=result.past_key_values, use_cache=True)
    return out


@pytest.fixture(scope="session")
def hf_greedy():
    return _hf_greedy
