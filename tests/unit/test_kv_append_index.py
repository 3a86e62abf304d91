"""The paged append's index (`AppendIndex`): every token a one-page request whose page table is the slot mapping, so
the kernel's page arithmetic lands each token on its own slot; and the backend's write path choosing the append or
the scatter. The kernel itself is emulated here (its addressing, written out from flashinfer's AppendPagedKVCacheKernel);
tests/gpu/test_kv_write_gpu.py runs the real one against the scatter."""

from __future__ import annotations

import torch

from bullet_ray.engine.attention.flashinfer_backend import AppendIndex, FlashInferBackend, append_serves


def _kernel_slots(index: AppendIndex, block_size: int) -> list[int]:
    """The slot flashinfer's kernel writes token i to: (page_iter, entry) = divmod(indptr[batch[i]] * bs + pos[i], bs),
    page = indices[page_iter]."""
    out = []
    for i in range(index.batch_indices.shape[0]):
        b = int(index.batch_indices[i])
        page_iter, entry = divmod(int(index.indptr[b]) * block_size + int(index.positions[i]), block_size)
        out.append(int(index.pages[page_iter]) * block_size + entry)
    return out


def test_every_token_lands_on_its_slot():
    slots = torch.tensor([37, 0, 15, 16, 1023, 500, 501, 7], dtype=torch.int64)
    for bs in (16, 32):
        index = AppendIndex(slots, bs)
        assert _kernel_slots(index, bs) == slots.tolist()
        assert index.indptr.dtype == index.pages.dtype == index.positions.dtype == torch.int32
        assert index.last_page_len.shape[0] == index.batch_indices.shape[0] == len(slots)  # batch size = tokens
        assert index.indptr.shape[0] == len(slots) + 1
        assert index.batch_indices.is_contiguous() and index.last_page_len.is_contiguous()


class _EmulatedPageModule:
    """flashinfer's append_paged_kv_cache written out in torch (NHD), counting its calls."""

    calls = 0

    def append_paged_kv_cache(self, k, v, batch_indices, positions, k_cache, v_cache, pages, indptr, last_page_len,
                              layout):
        # the C++ wrapper's checks (flashinfer csrc/page.cu): what the real kernel refuses, this refuses too
        assert layout == 0 and k.stride(-1) == 1 and v.stride(-1) == 1 and k.dim() == v.dim() == 3
        n = k.shape[0]
        for t in (batch_indices, positions, pages, indptr, last_page_len):
            assert t.dtype == torch.int32 and t.is_contiguous() and t.dim() == 1
        assert indptr.shape[0] == last_page_len.shape[0] + 1 and batch_indices.shape[0] == positions.shape[0] == n
        assert k_cache.dim() == v_cache.dim() == 4 and k_cache.stride() == v_cache.stride()
        assert k_cache.stride(-1) == 1 and k.shape[1:] == k_cache.shape[2:] and n > 0
        self.calls += 1
        bs = k_cache.shape[1]
        index = type("I", (), {"batch_indices": batch_indices, "positions": positions, "pages": pages,
                               "indptr": indptr})()
        for i, slot in enumerate(_kernel_slots(index, bs)):
            k_cache[slot // bs, slot % bs] = k[i]
            v_cache[slot // bs, slot % bs] = v[i]


def _backend(append: bool) -> FlashInferBackend:
    backend = object.__new__(FlashInferBackend)  # the write path alone: no flashinfer needed
    backend.kv_cache = torch.zeros(2, 4, 2, 4, 2, 3)  # [layers, blocks, K/V, block_size, kv_heads, head_dim]
    backend._rows_md, backend._kv_rows, backend._append_index = None, None, None
    backend._append_module = _EmulatedPageModule() if append else None
    backend.bind_layer_views()
    return backend


def test_append_writes_what_the_scatter_writes_from_fused_and_separate_kv():
    torch.manual_seed(0)
    md = type("Md", (), {})()
    md.slot_mapping = torch.tensor([5, 0, 14, 9, 3])
    qkv = torch.randn(5, 2 * 6 + 2 * 6)  # q (two heads of 3, made up) then k then v
    fused_k, fused_v = qkv[:, 12:18].view(5, 2, 3), qkv[:, 18:].view(5, 2, 3)
    for k, v in ((fused_k, fused_v), (fused_k.contiguous(), fused_v.contiguous())):
        appended, scattered = _backend(True), _backend(False)
        for layer in range(2):
            appended.write_kv(layer, k + layer, v - layer, md)
            scattered.write_kv(layer, k + layer, v - layer, md)
        assert appended._append_module.calls == 2
        assert torch.equal(appended.kv_cache, scattered.kv_cache)
        assert appended.kv_cache.abs().sum() > 0


def test_the_scatter_serves_where_the_append_cannot():
    """A decode graph writing row 0 last, K/V of another dtype than the pool's, or no tokens: the scatter path."""
    md = type("Md", (), {})()
    md.slot_mapping = torch.tensor([1, 5])
    k = torch.ones(2, 2, 3)
    backend = _backend(True)
    backend.first_row_writes_last = True
    backend.write_kv(0, k, -k, md)
    backend.first_row_writes_last = False
    backend.forget_batch()
    backend.write_kv(0, k.double(), -k.double(), md)
    assert backend._append_module.calls == 0
    backend.write_kv(0, k, -k, md)
    assert backend._append_module.calls == 1
    empty = type("Md", (), {"slot_mapping": torch.zeros(0, dtype=torch.int64)})()
    backend.write_kv(0, k[:0], -k[:0], empty)  # no tokens: the kernel's launcher would make an empty grid
    assert backend._append_module.calls == 1
    assert backend.kv_cache[0, 0, 0, 1].eq(1).all() and backend.kv_cache[0, 1, 1, 1].eq(-1).all()


def test_the_append_serves_only_what_its_launcher_dispatches():
    """Head sizes 64-512 in half precision; another head size or a float32 / fp8 pool keeps the scatter."""
    assert append_serves(128, torch.bfloat16) and append_serves(64, torch.float16) and append_serves(256, torch.bfloat16)
    assert not append_serves(96, torch.bfloat16) and not append_serves(16, torch.bfloat16)
    assert not append_serves(128, torch.float32) and not append_serves(128, torch.float8_e4m3fn)


def test_an_index_derived_into_fixed_buffers_writes_the_same_kv():
    """With `write_index_buffers` (a decode step captured in pieces) the backend derives each batch's write index
    into the buffers' leading rows, append or scatter, and writes what it writes without them; a batch after it
    overwrites them in place (the buffers are shared by every piece and partition of a step)."""
    from bullet_ray.engine.attention.flashinfer_backend import WriteIndexBuffers

    slots = torch.tensor([37, 0, 15, 16, 1023])
    plain, into = AppendIndex(slots, 16), AppendIndex(slots, 16, WriteIndexBuffers(8, "cpu"))
    for name in ("indptr", "batch_indices", "last_page_len", "pages", "positions"):
        assert torch.equal(getattr(plain, name), getattr(into, name)), name
    assert into.batch_indices.is_contiguous() and into.last_page_len.is_contiguous()
    torch.manual_seed(0)
    md = type("Md", (), {})()
    md.slot_mapping = torch.tensor([5, 0, 14, 9, 3])
    k, v = torch.randn(5, 2, 3), torch.randn(5, 2, 3)
    for append in (True, False):
        plain_be, fixed = _backend(append), _backend(append)
        buffers = fixed.write_index_buffers = WriteIndexBuffers(8, "cpu")
        for layer in range(2):
            plain_be.write_kv(layer, k + layer, v - layer, md)
            fixed.write_kv(layer, k + layer, v - layer, md)
        assert torch.equal(plain_be.kv_cache, fixed.kv_cache) and fixed.kv_cache.abs().sum() > 0
        if append:
            assert fixed._append_index.pages.data_ptr() == buffers.pages.data_ptr()
        else:
            assert fixed._kv_rows.data_ptr() == buffers.kv_rows.data_ptr()
        other = type("Md", (), {"slot_mapping": torch.tensor([12, 13])})()
        fixed.write_kv(0, k[:2], v[:2], other)
        if append:  # the pool's blocks are of 4 slots here
            assert (buffers.pages[:2] * 4 + buffers.positions[:2]).tolist() == [12, 13]
        else:  # a layer's rows interleave each block's K and V slots: slot + (slot // 4) * 4
            assert buffers.kv_rows[:2].tolist() == [[24, 28], [25, 29]]
