"""The direct decode plan on the GPU (`DirectDecodePlan`, `BULLET_RAY_DECODE_PLAN=direct`): flashinfer's compiled
planner called without the wrapper's Python gives the wrapper's own plan (its description and the work list it
writes, page-locked and on the device) for unsplit, balanced-split and flashinfer-chosen plans at Llama-3.1-8B's
heads, and decode graphs planned that way give eager decode's hidden states as their rows grow past page bounds.

Run: python -m pytest tests/gpu/test_decode_plan_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_engine_gpu import _decode_inputs, _tiny_model

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def _pinned(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32).pin_memory()


def _cases() -> list[tuple[list[int], dict]]:
    from bullet_ray.engine.attention.flashinfer_backend import balanced_kv_chunk_pages

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    skewed = [80] * 31 + [400]
    chunk = balanced_kv_chunk_pages(skewed, KV_HEADS, sms)
    assert chunk is not None
    return [([80] * 32, {"disable_split_kv": True}), (skewed, {"fixed_split_size": chunk}), (skewed, {}),
            ([3] * 31 + [900], {}), ([81] * 31 + [401], {"fixed_split_size": chunk})]


def test_the_direct_plan_writes_the_wrappers_own_plan():
    import flashinfer

    from bullet_ray.engine.attention.flashinfer_backend import DirectDecodePlan

    b = 32
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    buffers = (torch.zeros(b + 1, dtype=torch.int32, device="cuda"), torch.zeros(4096, dtype=torch.int32, device="cuda"),
               torch.zeros(b, dtype=torch.int32, device="cuda"))
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, kv_layout="NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=buffers[0],
        paged_kv_indices_buffer=buffers[1], paged_kv_last_page_len_buffer=buffers[2])
    direct = DirectDecodePlan(HEADS, KV_HEADS, HEAD_DIM, PAGE)
    assert not DirectDecodePlan.serves(wrapper)  # not planned yet: no compiled module

    def plan_by_wrapper(pages: list[int], options: dict) -> None:
        indptr = _pinned([0, *torch.tensor(pages).cumsum(0).tolist()])
        last = _pinned([(7 * i) % PAGE + 1 for i in range(len(pages))])
        indices = torch.arange(sum(pages), dtype=torch.int32, device="cuda")
        wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, HEAD_DIM, PAGE, q_data_type=torch.bfloat16,
                     kv_data_type=torch.bfloat16, sm_scale=HEAD_DIM ** -0.5, **options)

    plan_by_wrapper([80] * b, {})
    assert DirectDecodePlan.serves(wrapper)
    pinned, device = wrapper._pin_memory_int_workspace_buffer, wrapper._int_workspace_buffer
    for pages, options in _cases():
        torch.cuda.synchronize()
        pinned.zero_()
        device.zero_()
        plan_by_wrapper(pages, options)
        torch.cuda.synchronize()
        own = (tuple(int(x) for x in wrapper._plan_info), pinned.clone(), device.cpu())
        pinned.zero_()
        device.zero_()
        indptr = _pinned([0, *torch.tensor(pages).cumsum(0).tolist()])
        last = _pinned([(7 * i) % PAGE + 1 for i in range(len(pages))])
        direct(wrapper, indptr, last, **options)
        torch.cuda.synchronize()
        assert tuple(int(x) for x in wrapper._plan_info) == own[0], (pages[-1], options)
        assert torch.equal(pinned, own[1]) and torch.equal(device.cpu(), own[2]), (pages[-1], options)


# five rows (below 16: flashinfer's own split) and twenty with one long row (from 16: the balanced split, 16 pages)
LAYOUTS = {"five": [[5, 20, 33, 70, 1], [21, 36, 49, 86, 17], [22, 37, 50, 87, 18]],
           "twenty": [[3] * 19 + [470], [4] * 19 + [486], [5] * 19 + [487]]}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_decode_graphs_planned_directly_equal_eager(monkeypatch, layout):
    """Decode graphs built under BULLET_RAY_DECODE_PLAN=direct (tensor-core kernel): the first plan of a bucket by the
    wrapper, the next ones (rows grown past a page bound: a new plan) by its planner directly, unsplit, with
    flashinfer's split or the balanced one; each step's hidden states equal eager decode's."""
    from bullet_ray.engine.attention.base import AttentionContext, get_backend_class
    from bullet_ray.engine.cuda_graphs import DecodeGraphs

    monkeypatch.setenv("BULLET_RAY_DECODE_PLAN", "direct")
    model, cfg = _tiny_model(2)
    kv = torch.randn(cfg.num_hidden_layers, 64, 2, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
    backend = get_backend_class("flashinfer")(kv, 4, 2, 128, 128 ** -0.5, decode_tensor_cores=True)
    assert backend.decode_tensor_cores
    graphs = DecodeGraphs(model, backend, 16, 32, 32, torch.device("cuda"), scratch_slot=63 * 16)
    assert graphs.capture_report()["decode_plan"] == "direct"
    for step, seq_lens in enumerate(LAYOUTS[layout]):
        md, ids, pos, tables = _decode_inputs(seq_lens, first_id=3 + step)
        saved = kv.clone()
        with torch.inference_mode():
            backend.begin_batch(md)
            eager = model.forward(ids, pos, AttentionContext(backend, md))
            kv.copy_(saved)
            graphed = graphs.run(0, ids, pos, md, tables).clone()
        torch.cuda.synchronize()
        rel = float((graphed.float() - eager.float()).norm() / eager.float().norm())
        assert rel < 1e-2, (step, rel)
    assert graphs.num_plans_direct >= 1  # the second step's pages changed: planned again, directly
