"""The flashinfer backend's plans without a GPU: which wrapper gets which rows, blocks and indices.

A mixed batch of the chunked schedule (decodes first) is planned in two parts: the leading one-token rows
on the decode wrapper, the prompt chunks on the prefill wrapper; the kernels themselves are compared with the
torch reference in tests/gpu/test_engine_gpu.py.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from bullet_ray.engine.attention.base import AttentionMetadata
from bullet_ray.engine.attention.flashinfer_backend import FlashInferBackend


class _RecordingFence:
    def __init__(self) -> None:
        self.plans: list[tuple[str, list]] = []
        self.options: list[dict] = []

    def plan(self, wrapper: str, *args: object, **kwargs: object) -> None:
        self.plans.append((wrapper, [a.tolist() if isinstance(a, torch.Tensor) else a for a in args[:5]]))
        self.options.append({k: v for k, v in kwargs.items() if k == "disable_split_kv"})


def _backend() -> FlashInferBackend:
    backend = object.__new__(FlashInferBackend)  # no flashinfer: only the planning code runs
    backend.decode_tensor_cores, backend.decode_split_kv_rows = True, None
    return backend


def _plans(query_lens: list[int], seq_lens: list[int], split: bool = True) -> tuple[list, int]:
    backend = _backend()
    backend.fence, backend.decode, backend.prefill = _RecordingFence(), "decode", "prefill"
    backend.kv_cache = torch.zeros(1, 40, 2, 16, 2, 8)
    backend.num_heads, backend.num_kv_heads, backend.head_dim, backend.scale = 4, 2, 8, 1.0
    backend.split_mixed_batches = split
    with mock.patch("torch.Tensor.pin_memory", lambda t: t):  # no CUDA to page-lock with
        backend.begin_batch(AttentionMetadata.contiguous(query_lens, seq_lens, 16, "cpu"))
    return backend.fence.plans, backend._num_decode_rows


def test_leading_decodes_of_a_mixed_batch_go_to_the_decode_kernel():
    plans, num_decode = _plans([1, 1, 1, 20, 7], [33, 1, 70, 20, 90])
    assert num_decode == 3
    # decode: indptr over the three rows' blocks (3, 1, 5), their block ids, last-page lengths
    assert plans[0] == ("decode", [[0, 3, 4, 9], list(range(9)), [1, 1, 6], 4, 2])
    # prefill: query offsets of the two chunks, their blocks (2, 6) and ids from block 9 on
    assert plans[1] == ("prefill", [[0, 20, 27], [0, 2, 8], list(range(9, 17)), [4, 10], 4])


def test_without_the_split_every_row_goes_to_the_prefill_kernel():
    plans, num_decode = _plans([1, 1, 1, 20, 7], [33, 1, 70, 20, 90], split=False)
    assert num_decode == 0
    assert plans == [("prefill", [[0, 1, 2, 3, 23, 30], [0, 3, 4, 9, 11, 17], list(range(17)), [1, 1, 6, 4, 10], 4])]


@pytest.mark.parametrize("query_lens,seq_lens,wrappers", [
    ([1, 20, 1], [33, 20, 70], ["decode", "prefill"]),  # only the leading decode is split off
    ([5, 3], [5, 40], ["prefill"]),  # no decode rows
    ([1, 1], [17, 40], ["decode"]),  # a pure decode batch: one plan, as before
])
def test_plans_per_batch_shape(query_lens, seq_lens, wrappers):
    plans, _ = _plans(query_lens, seq_lens)
    assert [w for w, _ in plans] == wrappers
    planned_rows = sum(len(args[0]) - 1 for _, args in plans)
    assert planned_rows == len(query_lens)


def test_decode_tensor_cores_default_follows_the_gqa_group_and_the_environment(monkeypatch):
    """On where a KV head serves >= 4 query heads (SGLang's rule; Llama-3.1-8B 32 / 8), off below (SmolLM2
    9 / 3) unless BULLET_RAY_DECODE_TENSOR_CORES says otherwise."""
    from bullet_ray.engine.attention.flashinfer_backend import default_decode_tensor_cores

    monkeypatch.delenv("BULLET_RAY_DECODE_TENSOR_CORES", raising=False)
    assert default_decode_tensor_cores(32, 8) is True
    assert default_decode_tensor_cores(9, 3) is False
    monkeypatch.setenv("BULLET_RAY_DECODE_TENSOR_CORES", "1")
    assert default_decode_tensor_cores(9, 3) is True
    monkeypatch.setenv("BULLET_RAY_DECODE_TENSOR_CORES", "0")
    assert default_decode_tensor_cores(32, 8) is False
    monkeypatch.setenv("BULLET_RAY_DECODE_TENSOR_CORES", "yes")
    with pytest.raises(ValueError, match="BULLET_RAY_DECODE_TENSOR_CORES"):
        default_decode_tensor_cores()


def test_decode_split_kv_follows_the_batch_and_the_environment_and_reaches_every_decode_plan(monkeypatch):
    """By default a tensor-core decode plan of 24 rows or more goes without split-KV (eager here, and
    DecodeGraphs' through the same `decode_plan_options` with its bucket); BULLET_RAY_DECODE_SPLIT_KV=1 lets
    every plan split, =0 none; the CUDA-core kernel takes no such option."""
    from bullet_ray.engine.attention.flashinfer_backend import SPLIT_KV_MAX_ROWS, default_decode_split_kv_rows

    monkeypatch.delenv("BULLET_RAY_DECODE_SPLIT_KV", raising=False)
    assert default_decode_split_kv_rows() == SPLIT_KV_MAX_ROWS == 24
    monkeypatch.setenv("BULLET_RAY_DECODE_SPLIT_KV", "1")
    assert default_decode_split_kv_rows() is None
    monkeypatch.setenv("BULLET_RAY_DECODE_SPLIT_KV", "0")
    assert default_decode_split_kv_rows() == 0
    monkeypatch.setenv("BULLET_RAY_DECODE_SPLIT_KV", "no")
    with pytest.raises(ValueError, match="BULLET_RAY_DECODE_SPLIT_KV"):
        default_decode_split_kv_rows()
    backend = _backend()
    assert backend.decode_plan_options(300) == {}
    backend.decode_split_kv_rows = 24
    assert backend.decode_plan_options(16) == {}
    assert backend.decode_plan_options(24) == backend.decode_plan_options(300) == {"disable_split_kv": True}
    backend.decode_split_kv_rows = 0
    assert backend.decode_plan_options(1) == {"disable_split_kv": True}
    backend.decode_tensor_cores = False
    assert backend.decode_plan_options(64) == {}
    backend.decode_tensor_cores = True
    backend.fence, backend.decode, backend.prefill = _RecordingFence(), "decode", "prefill"
    backend.kv_cache = torch.zeros(1, 40, 2, 16, 2, 8)
    backend.num_heads, backend.num_kv_heads, backend.head_dim, backend.scale = 4, 2, 8, 1.0
    backend.split_mixed_batches = True
    with mock.patch("torch.Tensor.pin_memory", lambda t: t):
        backend.begin_batch(AttentionMetadata.contiguous([1, 1, 20], [33, 70, 20], 16, "cpu"))
    assert backend.fence.options == [{"disable_split_kv": True}, {}]  # the decode rows' plan, then the prefill's
