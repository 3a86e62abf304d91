"""The flashinfer backend's plans without a GPU: which wrapper gets which rows, blocks and indices.

A mixed batch of the chunked schedule (decodes first) is planned in two parts: the leading one-token rows
on the decode wrapper, the prompt chunks on the prefill wrapper; the kernels themselves are compared with the
torch reference in tests/gpu/test_engine_gpu.py.
"""

from __future__ import annotations

import random
from unittest import mock

import pytest
import torch

from bullet_ray.engine.attention.base import AttentionMetadata
from bullet_ray.engine.attention.flashinfer_backend import FlashInferBackend


class _RecordingFence:
    def __init__(self) -> None:
        self.plans: list[tuple[str, list]] = []
        self.options: list[dict] = []

    def plan(self, wrapper: str, *args: object, **kwargs: object) -> float:
        self.plans.append((wrapper, [a.tolist() if isinstance(a, torch.Tensor) else a for a in args[:5]]))
        self.options.append({k: v for k, v in kwargs.items() if k == "disable_split_kv"})
        return 0.0  # PlanFence.plan: the host's wait for the wrapper's previous plan


def _backend() -> FlashInferBackend:
    backend = object.__new__(FlashInferBackend)  # no flashinfer: only the planning code runs
    backend.decode_tensor_cores, backend.decode_split_kv_rows = True, None
    return backend


def _planned(query_lens: list[int], seq_lens: list[int], split: bool = True, holistic: bool = False,
             default_stream: bool = True, fence: _RecordingFence | None = None) -> FlashInferBackend:
    """A backend (no flashinfer) after `begin_batch` of one batch; its fence holds the plans."""
    backend = _backend()
    backend.fence, backend.decode, backend.prefill = fence or _RecordingFence(), "decode", "prefill"
    backend.holistic = "holistic" if holistic else None
    backend.kv_cache = torch.zeros(1, 40, 2, 16, 2, 8)
    backend.num_heads, backend.num_kv_heads, backend.head_dim, backend.scale = 4, 2, 8, 1.0
    backend.split_mixed_batches = split
    streams = (mock.Mock(cuda_stream=1), mock.Mock(cuda_stream=1 if default_stream else 2))  # default, current
    with mock.patch("torch.Tensor.pin_memory", lambda t: t), \
            mock.patch("torch.cuda.default_stream", lambda device=None: streams[0]), \
            mock.patch("torch.cuda.current_stream", lambda device=None: streams[1]):  # no CUDA to page-lock with
        backend.begin_batch(AttentionMetadata.contiguous(query_lens, seq_lens, 16, "cpu"))
    return backend


def _plans(query_lens: list[int], seq_lens: list[int], split: bool = True, holistic: bool = False) -> tuple[list, int]:
    backend = _planned(query_lens, seq_lens, split, holistic)
    return backend.fence.plans, backend._num_decode_rows


def test_leading_decodes_of_a_mixed_batch_go_to_the_decode_kernel():
    plans, num_decode = _plans([1, 1, 1, 20, 7], [33, 1, 70, 20, 90])
    assert num_decode == 3
    # decode: indptr over the three rows' blocks (3, 1, 5), their block ids, last-page lengths
    assert plans[0] == ("decode", [[0, 3, 4, 9], list(range(9)), [1, 1, 6], 4, 2])
    # prefill: query offsets of the two chunks, their blocks (2, 6) and ids from block 9 on
    assert plans[1] == ("prefill", [[0, 20, 27], [0, 2, 8], list(range(9, 17)), [4, 10], 4])


@pytest.mark.parametrize("query_lens,seq_lens,wrappers", [
    ([1, 1, 1, 20, 7], [33, 1, 70, 20, 90], ["holistic"]),  # mixed, decodes first: every row in one kernel
    ([5, 3], [5, 40], ["prefill"]),  # no decode rows: the prefill kernel, as in the split mode
    ([1, 1], [17, 40], ["decode"]),  # a pure decode batch: the decode kernel (and its CUDA graphs)
])
def test_holistic_mode_plans_a_mixed_batch_once_over_every_row(query_lens, seq_lens, wrappers):
    plans, _ = _plans(query_lens, seq_lens, holistic=True)
    assert [w for w, _ in plans] == wrappers
    if wrappers == ["holistic"]:  # query offsets, block offsets, context lengths, every block id, page size
        assert plans[0][1] == [[0, 1, 2, 3, 23, 30], [0, 3, 4, 9, 11, 17], seq_lens, list(range(17)), 16]


def test_holistic_mode_splits_off_the_default_stream_and_when_its_planner_refuses():
    """A green context's stream (a partition of the SMs) cannot hold the persistent kernel's cooperative grid, and
    flashinfer's planner raises past its limits: both run the step split, the second counted."""
    backend = _planned([1, 1, 1, 20, 7], [33, 1, 70, 20, 90], holistic=True, default_stream=False)
    assert [w for w, _ in backend.fence.plans] == ["decode", "prefill"] and not backend._holistic_planned

    class _RefusingFence(_RecordingFence):
        def plan(self, wrapper, *args, **kwargs):
            if wrapper == "holistic":
                raise RuntimeError("total_num_works exceeds the limit")
            return super().plan(wrapper, *args, **kwargs)

    backend = _planned([1, 1, 1, 20, 7], [33, 1, 70, 20, 90], holistic=True, fence=_RefusingFence())
    assert [w for w, _ in backend.fence.plans] == ["decode", "prefill"] and backend.holistic_fallbacks == 1


def test_an_mps_thread_cap_is_read_from_the_environment(monkeypatch):
    """Holistic attention (a cooperative grid over every SM) is off in a process whose MPS share is capped."""
    from bullet_ray.engine.attention.flashinfer_backend import mps_thread_cap

    for value, cap in ((None, None), ("100", None), ("", None), ("60", "60"), (" 45.5 ", "45.5")):
        if value is None:
            monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
        else:
            monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", value)
        assert mps_thread_cap() == cap


def test_holistic_attention_plans_and_runs_the_compiled_module_with_its_arguments():
    """After the wrapper's first plan (which loads the module), every plan and run goes to the module directly,
    in BatchAttention's argument order: no device sync, no LSE, q and K/V as given, the output written in place."""
    from bullet_ray.engine.attention.holistic import HolisticAttention

    calls = []

    class _Module:
        def plan(self, *args):
            calls.append(("module.plan", args))
            return [7, 8]

        def run(self, *args):
            calls.append(("module.run", args))

    class _Wrapper:
        float_workspace_buffer, int_workspace_buffer, page_locked_int_workspace_buffer = "fws", "iws", "pws"

        def plan(self, *args, **kwargs):
            calls.append(("wrapper.plan", args, kwargs))
            self.module, self._plan_info = _Module(), [1, 2]

    h = object.__new__(HolisticAttention)
    h.wrapper, h.num_heads, h.num_kv_heads, h.head_dim, h.dtype, h.scale = _Wrapper(), 32, 8, 128, "bf16", 0.5
    h._causal, h._layout, h._module, h._plan_info, h._kv_indices, h._page_size = 1, 0, None, None, None, 0
    h.plan("qo", "kvp", [5, 6], "idx", 16)  # first: the wrapper (kv_lens before kv_indices in its signature)
    assert calls[-1] == ("wrapper.plan", ("qo", "kvp", "idx", [5, 6], 32, 8, 128, 128, 16),
                         {"causal": True, "sm_scale": 0.5, "q_data_type": "bf16", "kv_data_type": "bf16"})
    h.plan("qo2", "kvp2", [5, 6, 9], "idx2", 16)
    assert calls[-1] == ("module.plan", ("fws", "iws", "pws", "qo2", "kvp2", [5, 6, 9], 3, 32, 8, 128, True))
    out = torch.zeros(4, 32, 128)
    assert h.run("q", "k", "v", out) is out
    assert calls[-1] == ("module.run", ("fws", "iws", [7, 8], "q", "k", "v", "idx2", out, None, 1, 0, 32, 8, 16,
                                        1.0, 0.5, 0.0, None, None))


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
    """By default a tensor-core decode plan of 16 rows or more is split by the balanced rule (only its longest
    rows; none when the rows are alike), eager here and DecodeGraphs' through the same `decode_plan_options`
    with its bucket; BULLET_RAY_DECODE_SPLIT_KV=1 leaves every plan to flashinfer, =0 splits none; the
    CUDA-core kernel takes no such option."""
    from bullet_ray.engine.attention.flashinfer_backend import SPLIT_KV_MAX_ROWS, default_decode_split_kv_rows

    monkeypatch.delenv("BULLET_RAY_DECODE_SPLIT_KV", raising=False)
    assert default_decode_split_kv_rows() == SPLIT_KV_MAX_ROWS == 16
    monkeypatch.setenv("BULLET_RAY_DECODE_SPLIT_KV", "1")
    assert default_decode_split_kv_rows() is None
    monkeypatch.setenv("BULLET_RAY_DECODE_SPLIT_KV", "0")
    assert default_decode_split_kv_rows() == 0
    monkeypatch.setenv("BULLET_RAY_DECODE_SPLIT_KV", "no")
    with pytest.raises(ValueError, match="BULLET_RAY_DECODE_SPLIT_KV"):
        default_decode_split_kv_rows()
    backend = _backend()
    backend.num_heads, backend.num_kv_heads, backend.head_dim, backend.num_sms = 32, 8, 128, 132
    alike, skewed = [80] * 32, [80] * 31 + [400]
    assert backend.decode_plan_options(alike * 10) == {}  # limit None: flashinfer's own
    backend.decode_split_kv_rows = SPLIT_KV_MAX_ROWS
    assert backend.decode_plan_options([400] + [80] * 14) == {}  # under the limit: flashinfer's own
    # 16 rows alike (Llama-3.1-8B x 1k on 132 SMs): no split, eagerly and in the bucket of 16; one long row: split
    assert backend.decode_plan_options([64] * 16) == backend.decode_plan_options([65] * 16, graph_rows=16) \
        == {"disable_split_kv": True}
    assert "fixed_split_size" in backend.decode_plan_options([64] * 15 + [445], graph_rows=16)
    assert backend.decode_plan_options(alike) == backend.decode_plan_options(alike * 10) == {"disable_split_kv": True}
    chunk = backend.decode_plan_options(skewed)["fixed_split_size"]  # eager: the fair share, 32 x 80 + 320 pages
    assert chunk == -(-(31 * 80 + 400) * 8 // 264)
    graph = backend.decode_plan_options(skewed, graph_rows=32)["fixed_split_size"]
    assert graph >= chunk and sum(-(-p // graph) for p in skewed) <= 39  # the bucket of 32's padded grid
    backend.decode_split_kv_rows = 0
    assert backend.decode_plan_options([1]) == backend.decode_plan_options(skewed) == {"disable_split_kv": True}
    backend.decode_tensor_cores = False
    assert backend.decode_plan_options(skewed) == {}
    backend.decode_tensor_cores = True
    backend.decode_split_kv_rows = 24
    backend.fence, backend.decode, backend.prefill = _RecordingFence(), "decode", "prefill"
    backend.kv_cache = torch.zeros(1, 40, 2, 16, 2, 8)
    backend.num_heads, backend.num_kv_heads, backend.head_dim, backend.scale = 4, 2, 8, 1.0
    backend.split_mixed_batches = True
    query_lens, seq_lens = [1] * 24 + [20], [33] * 24 + [20]
    with mock.patch("torch.Tensor.pin_memory", lambda t: t):
        backend.begin_batch(AttentionMetadata.contiguous(query_lens, seq_lens, 16, "cpu"))
    assert backend.fence.options == [{"disable_split_kv": True}, {}]  # the 24 decode rows' plan, then the prefill's


def test_balanced_split_evens_out_the_longest_rows_within_the_graph_grid():
    """The chunk is the batch's fair share per CTA slot (pages x KV heads / (2 x SMs), at least MIN_SPLIT_PAGES),
    grown until the chunks fit a graph's padded grid; no split where no row is 1.5 chunks long; the grid of a
    bucket is max(2 x SMs / KV heads, ceil(rows x group / 16) + rows - 1), flashinfer's."""
    from bullet_ray.engine.attention.flashinfer_backend import (
        MIN_SPLIT_PAGES,
        balanced_kv_chunk_pages,
        graph_grid_chunks,
        workspace_chunks,
    )

    assert graph_grid_chunks(8, 32, 8, 132) == 33 and graph_grid_chunks(64, 32, 8, 132) == 79
    assert graph_grid_chunks(1024, 32, 8, 132) == 256 + 1023
    assert graph_grid_chunks(64, 64, 1, 132) == 264  # one KV head: 2 x SMs CTAs
    assert graph_grid_chunks(512, 64, 1, 132) == 512 + 511  # a group of 64 packs into 64-row tiles: one per row
    # the split's partial outputs: half of the 256 MB workspace, one float32 query tile of every KV head a chunk
    assert workspace_chunks(32, 8, 128) == (128 << 20) // (8 * 16 * 128 * 4) == 2048
    assert workspace_chunks(32, 32, 128) == 512  # multi-head: a 16-row tile of every head
    assert balanced_kv_chunk_pages([2000] + [1] * 600, 32, 132, 600) is None  # not even unsplit rows fit
    assert balanced_kv_chunk_pages([], 8, 132) is None
    assert balanced_kv_chunk_pages([100] * 64, 8, 132) is None  # alike: nothing to even out
    assert balanced_kv_chunk_pages([3, 4, 40], 8, 132) == MIN_SPLIT_PAGES  # small batch: the floor
    assert balanced_kv_chunk_pages([3, 4, 20], 8, 132) is None  # 20 < 1.5 x 16
    rng = random.Random(0)
    for _ in range(300):
        rows = rng.randint(1, 300)
        pages = [rng.choice((1, rng.randint(1, 80), rng.randint(1, 900))) for _ in range(rows)]
        cap = graph_grid_chunks(rows, 32, 8, 132)
        for limit in (None, cap):
            chunk = balanced_kv_chunk_pages(pages, 8, 132, limit)
            if chunk is None:
                continue
            assert chunk >= MIN_SPLIT_PAGES and max(pages) * 2 > chunk * 3  # the longest row is split
            if limit is not None:
                assert sum(-(-p // chunk) for p in pages) <= limit
                if chunk > MIN_SPLIT_PAGES:  # the smallest chunk that fits, once past the fair share
                    share = -(-sum(pages) * 8 // 264)
                    assert chunk == share or sum(-(-p // (chunk - 1)) for p in pages) > limit


def test_split_chunk_caps_and_the_graph_variants_a_bucket_captures():
    """A backend's cap on a balanced split's chunks is the workspace's, and for a graph bucket also its padded
    grid's; a bucket captures a split variant only where a split can fit (more chunks than rows) and the rule
    applies (tensor-core kernel, rows >= the limit)."""
    from bullet_ray.engine.cuda_graphs import DecodeGraphs

    backend = _backend()
    backend.num_heads, backend.num_kv_heads, backend.head_dim, backend.num_sms = 32, 32, 128, 132
    backend.decode_split_kv_rows = 24
    assert backend.split_chunk_cap() == 512 and backend.split_chunk_cap(64) == 64 // 16 + 63  # ragged worst case
    graphs = object.__new__(DecodeGraphs)  # the variants need the backend only
    graphs.backend = backend
    assert graphs.plan_variants(16) == [None]  # under the limit: flashinfer's own split
    assert graphs.plan_variants(256) == [{"disable_split_kv": True}, {"fixed_split_size": 1}]
    assert graphs.plan_variants(512) == [None]  # the workspace holds 512 chunks: no room to split 512 rows
    backend.decode_split_kv_rows = 0
    assert graphs.plan_variants(256) == [None]
    backend.decode_split_kv_rows, backend.decode_tensor_cores = 24, False
    assert graphs.plan_variants(256) == [None]


def test_mixed_attention_splits_unless_the_environment_says_otherwise(monkeypatch):
    from bullet_ray.engine.attention.flashinfer_backend import default_mixed_attention

    monkeypatch.delenv("BULLET_RAY_MIXED_ATTENTION", raising=False)
    assert default_mixed_attention() == "split"
    for mode in ("split", "overlap", "holistic"):
        monkeypatch.setenv("BULLET_RAY_MIXED_ATTENTION", mode)
        assert default_mixed_attention() == mode
    monkeypatch.setenv("BULLET_RAY_MIXED_ATTENTION", "1")
    with pytest.raises(ValueError, match="BULLET_RAY_MIXED_ATTENTION must be one of split, overlap, holistic, got '1'"):
        default_mixed_attention()
    monkeypatch.setenv("BULLET_RAY_MIXED_ATTENTION", "split")
    monkeypatch.setenv("BULLET_RAY_MIXED_ATTENTION_OVERLAP", "1")  # the old opt-in's name: an error, not ignored
    with pytest.raises(ValueError, match="set BULLET_RAY_MIXED_ATTENTION=overlap"):
        default_mixed_attention()


def test_the_plan_fence_returns_the_hosts_wait_for_the_wrappers_previous_plan(monkeypatch):
    """`PlanFence.plan` waits for the GPU to take a wrapper's previous plan before planning it again, and returns how
    long the host waited (DecodeGraphs adds it to the step log's graph_wait_ms); the first plan waits for nothing."""
    from bullet_ray.engine.attention import flashinfer_backend as fb

    clock = [0.0]
    monkeypatch.setattr(fb.time, "perf_counter", lambda: clock[0])

    class _Event:
        def record(self) -> None:
            pass

        def synchronize(self) -> None:
            clock[0] += 0.0015  # the GPU takes the previous plan 1.5 ms later

    monkeypatch.setattr(fb.torch.cuda, "Event", _Event)
    planned: list[tuple] = []

    class _Wrapper:
        def plan(self, *args: object, **kwargs: object) -> None:
            planned.append(args)

    fence, wrapper, other = fb.PlanFence(), _Wrapper(), _Wrapper()
    assert fence.plan(wrapper, 1) == 0.0  # nothing planned before
    assert fence.plan(other, 2) == 0.0  # another wrapper: its own fence
    assert fence.plan(wrapper, 3) == pytest.approx(0.0015)
    assert planned == [(1,), (2,), (3,)] and fence.plan_count(wrapper) == 2


def test_the_direct_decode_plan_calls_the_compiled_planner_as_the_wrapper_would(monkeypatch):
    """`DirectDecodePlan` (BULLET_RAY_DECODE_PLAN=direct, opt-in) serves only a CUDA-graph tensor-core wrapper on the
    fa2 path that a plan has set up, and calls its compiled planner with flashinfer 0.7.2 `_plan_impl`'s arguments:
    the one-token query indptr, the page indptr, the KV lengths in tokens as flashinfer's `get_seq_lens` computes
    them, the batch twice, the heads, CUDA-graph mode, no causal mask, no window, then the split options; its
    result becomes the wrapper's plan; `PlanFence.plan_by` counts and fences it like the wrapper's own plan."""
    from bullet_ray.engine.attention import flashinfer_backend as fb

    monkeypatch.delenv("BULLET_RAY_DECODE_PLAN", raising=False)
    assert fb.default_decode_plan() == "wrapper"
    monkeypatch.setenv("BULLET_RAY_DECODE_PLAN", "direct")
    assert fb.default_decode_plan() == "direct"
    monkeypatch.setenv("BULLET_RAY_DECODE_PLAN", "fast")
    with pytest.raises(ValueError, match="BULLET_RAY_DECODE_PLAN"):
        fb.default_decode_plan()
    calls: list[tuple] = []

    class _Module:
        def plan(self, *args: object) -> list[int]:
            calls.append(args)
            return [7, len(calls)]

    class _Wrapper:
        use_tensor_cores, is_cuda_graph_enabled, _backend, _cudnn_auto, _q_len_per_req = True, True, "fa2", False, 1
        _cached_module: object = _Module()
        _float_workspace_buffer, _int_workspace_buffer, _pin_memory_int_workspace_buffer = "float", "int", "pinned"
        _plan_info: object = None
        _sm_scale = 0.1  # set by a plan whose planner returned

    wrapper = _Wrapper()
    assert fb.DirectDecodePlan.serves(wrapper)
    for name, value in (("use_tensor_cores", False), ("is_cuda_graph_enabled", False), ("_backend", "fa3"),
                        ("_cached_module", None), ("_cudnn_auto", True), ("_q_len_per_req", 2)):
        other = _Wrapper()
        setattr(other, name, value)
        assert not fb.DirectDecodePlan.serves(other), name
    refused = _Wrapper()  # a first plan whose planner raised: module loaded, nothing `run` reads set
    del _Wrapper._sm_scale
    assert not fb.DirectDecodePlan.serves(refused)
    _Wrapper._sm_scale = 0.1
    direct = fb.DirectDecodePlan(32, 8, 128, 16)
    pages, last = [1, 3, 5, 1], [1, 16, 9, 4]
    indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32)
    last_t = torch.tensor(last, dtype=torch.int32)
    monkeypatch.setattr(fb.torch.cuda, "Event", lambda: mock.Mock())
    fence = fb.PlanFence()
    assert fence.plan_by(wrapper, lambda: direct(wrapper, indptr, last_t, fixed_split_size=4)) == 0.0
    direct(wrapper, indptr, last_t, disable_split_kv=True)
    direct(wrapper, indptr, last_t)
    assert fence.plan_count(wrapper) == 1 and wrapper._plan_info == [7, 3]
    expected_lens = (torch.clamp(indptr[1:] - indptr[:-1] - 1, min=0) * 16 + last_t).tolist()  # get_seq_lens
    assert expected_lens == [1, 48, 73, 4]
    for args, (split, disable) in zip(calls, ((4, False), (-1, True), (-1, False)), strict=True):
        assert args[:3] == ("float", "int", "pinned")
        assert args[3].tolist() == [0, 1, 2, 3, 4] and args[3].dtype == torch.int32
        assert args[4] is indptr and args[5].tolist() == expected_lens and args[5].dtype == torch.int32
        assert args[6:] == (4, 4, 32, 8, 16, True, 128, 128, False, -1, split, disable, 0, 0)
