"""Every row of a mixed batch (decode rows and prompt chunks) in one launch of flashinfer's persistent
`BatchAttention`: the `holistic` mode of FlashInferBackend (`BULLET_RAY_MIXED_ATTENTION=holistic`, opt-in; measured in
benchmarks/results/mixed_attention_holistic_h100/)."""

from __future__ import annotations

from typing import Any

import torch


class HolisticAttention:
    """flashinfer's persistent `BatchAttention` for a mixed batch's rows, all in one launch, planned without a
    host-device sync and run without the wrapper's Python.

    The wrapper's `plan` synchronises the whole device (it copies device index arrays to the host), which would
    stop the host from planning step k+1 while step k runs (asynchronous scheduling); our index arrays are already
    pinned host tensors, so after the wrapper's first plan (which loads the compiled module) the module's own plan
    runs directly: it fills the wrapper's page-locked buffer and queues its copy on the current stream, which
    `PlanFence` guards like any other wrapper's (the copy is the planner's whole work list, ~6 MB at Llama-3.1-8B's
    heads on 132 SMs by flashinfer 0.7.2's planner source, not measured; queued before the step's kernels). `run` calls the module's run per layer (q read at its
    strides, `out` written in place; no LSE). The kernel is a cooperative launch of two CTAs per SM of the device,
    so FlashInferBackend uses it on the default stream only and not under an MPS thread cap (a green context's
    partition or an MPS share holds fewer SMs; a batch there, or one the planner refuses, runs split), and
    its workspaces (384 MiB + 8 MiB on the device, 8 MiB page-locked) are allocated when the backend is built."""

    def __init__(self, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 scale: float) -> None:
        import flashinfer
        from flashinfer.utils import MaskMode, TensorLayout

        self.wrapper = flashinfer.BatchAttention(kv_layout="NHD", device=str(device))
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype, self.scale = dtype, scale
        self._causal = MaskMode.CAUSAL.value
        self._layout = TensorLayout["NHD"].value
        self._module: Any = None
        self._plan_info: Any = None
        self._kv_indices: torch.Tensor | None = None
        self._page_size = 0

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_lens: torch.Tensor,
             kv_indices: torch.Tensor, page_size: int) -> None:
        """Plan a batch: `qo_indptr` / `kv_indptr` (pages) / `kv_lens` (tokens) as pinned int32 host tensors,
        `kv_indices` the pages on the device; every row causal (a one-token row sees its whole context)."""
        w = self.wrapper
        if self._module is None:
            w.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, self.num_heads, self.num_kv_heads, self.head_dim,
                   self.head_dim, page_size, causal=True, sm_scale=self.scale, q_data_type=self.dtype,
                   kv_data_type=self.dtype)
            self._module, self._plan_info = w.module, w._plan_info
        else:
            self._plan_info = self._module.plan(w.float_workspace_buffer, w.int_workspace_buffer,
                                                w.page_locked_int_workspace_buffer, qo_indptr, kv_indptr, kv_lens,
                                                len(kv_lens), self.num_heads, self.num_kv_heads, self.head_dim, True)
        self._kv_indices, self._page_size = kv_indices, page_size

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """One layer's attention of the planned batch into `out` (written in place when contiguous)."""
        w = self.wrapper
        target = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=out.device)
        self._module.run(w.float_workspace_buffer, w.int_workspace_buffer, self._plan_info, q, k_cache, v_cache,
                         self._kv_indices, target, None, self._causal, self._layout, self.num_heads,
                         self.num_kv_heads, self._page_size, 1.0, self.scale, 0.0, None, None)
        if target is not out:
            out.copy_(target)
        return out
