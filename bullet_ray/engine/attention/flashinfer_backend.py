"""Paged attention on the GPU with flashinfer: paged prefill (incl. chunked prefill over a cached prefix)
and paged decode (prompt rows that start in the step through the ragged prefill by default, `prefill_attention`).

The pool layout is flashinfer's paged NHD layout ([num_blocks, 2, block_size, kv_heads, head_dim] per
layer), so the kernels read the shared pool in place. New K/V go into the pool by flashinfer's paged append
kernel (`kv_write` "append", the default: a grid-strided launch, a token's heads per CTA iteration, 16-byte
copies, reading K and V in place from the fused qkv projection's rows), each token its own one-page "request" so
that the page table is the slot mapping itself (`AppendIndex`); or (`kv_write` "scatter", and wherever the append
cannot serve: a K/V dtype other than the pool's, a head size or pool dtype its launcher does not dispatch, an empty
batch, a decode graph that must write row 0 last) into the layer viewed as rows of
[kv_heads, head_dim]: one `index_put_` of K and V when they are adjacent columns of one fused qkv row, else
one `index_copy_` each. The indices are computed once per batch. `begin_batch` plans the kernels once per step (prefill batches:
BatchPrefillWithPagedKVCache, causal; pure decode batches: BatchDecodeWithPagedKVCache; a mixed batch of the
chunked schedule, decodes first: its decode rows through the decode kernel and its prompt chunks through
the prefill kernel, since in the prefill kernel every one-token row fills a query tile of its own: 2.5-3x
the attention time of a 256-decode mixed step on the H100, benchmarks/gpu/mixed_attention.py; opt-in, the two on
two streams or every row in flashinfer's persistent BatchAttention: `default_mixed_attention`), `forward`
runs them per layer; both kernels read q in place (they take q's strides) and write into the caller's output
when given one (piecewise graphs pass their static buffer). After a plan's first layer, the other layers call
the wrapper's compiled module directly (`DirectRun`: flashinfer's `run` is ~50-80 us of Python per call). One
workspace buffer serves every wrapper and is allocated once.

Planning waits for the GPU only as far as it must: the page-table arrays flashinfer reads on the host go
in as CPU tensors, and what the kernels read goes to the device with asynchronous copies from pinned
memory, so the host plans the next step while the GPU still runs the last one. A wrapper's plan fills a
page-locked host buffer and queues its copy; `PlanFence` replans a wrapper only once that copy has run.

Decode rows run one kernel, eagerly as well as inside CUDA graphs (bullet_ray.engine.cuda_graphs), so a
sequence gets the same tokens whichever way its batch ran: flashinfer's CUDA-core decode kernel, or with
`decode_tensor_cores` its tensor-core one (the prefill kernel's code planned for one-token queries; SGLang
picks it when a KV head serves >= 4 query heads). In the H100 profile of the chunked schedule's mixed steps
(~120 decode rows at ~1.1k context beside ~1.9k prompt tokens; benchmarks/results/mixed_step_profile_h100)
the CUDA-core kernel took 10.4 of the step's ~55 ms of kernel time, reading the KV at ~1.7 TB/s; the
tensor-core kernel is 2-11% faster there. Decode-graph replays with padding rows did not match eager under
it on the GPU (sixth session); the cause was not the kernel's plan (in CUDA-graph mode it depends on the
batch size alone) but the padding rows' K/V writes into row 0's slot, which from the second layer on differ
from row 0's (one scatter leaves either, under either kernel: `store_first_row_last` wrote row 0 last
inside decode graphs; since the fifteenth session padding rows write the KV pool's scratch block instead,
and row 0 last only where a pool has none). Since that fix the GPU graph tests pass with both kernels, and
offline (300
Azure-conversation requests, chunked-2048, alternating runs on one H100) the tensor-core kernel serves
15.36 / 15.32 req/s against 14.14 / 14.15 (benchmarks/results/decode_tc_on_h100). So it is the default
where a KV head serves >= 4 query heads (Llama-3.1-8B: 32 / 8), as in SGLang; `BULLET_RAY_DECODE_TENSOR_CORES=1` /
`0` sets it for every backend the process builds.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from bullet_ray.config import PREFILL_ATTENTION_MODES
from bullet_ray.engine.attention.base import AttentionBackend, AttentionMetadata
from bullet_ray.engine.attention.direct_run import DirectRun
from bullet_ray.engine.attention.holistic import HolisticAttention
from bullet_ray.engine.transfer import to_device
from bullet_ray.gpu.partition import mps_thread_percentage
from bullet_ray.models.gpu_kernels import PDL

logger = logging.getLogger(__name__)

# flashinfer's CuTe-DSL norm kernels need nvidia-cutlass-dsl; its CUDA JIT kernels need nothing more
os.environ.setdefault("FLASHINFER_USE_CUDA_NORM", "1")

WORKSPACE_BYTES = 256 << 20


# query heads per KV head from which decode rows run the tensor-core kernel by default (SGLang's rule)
TENSOR_CORE_MIN_GROUP = 4


def default_decode_tensor_cores(num_heads: int = 1, num_kv_heads: int = 1) -> bool:
    """Whether decode rows run flashinfer's tensor-core kernel unless a backend is told otherwise:
    BULLET_RAY_DECODE_TENSOR_CORES (0 / 1) when set, else when a KV head serves >= 4 query heads."""
    value = os.environ.get("BULLET_RAY_DECODE_TENSOR_CORES")
    if value is None:
        return num_heads >= TENSOR_CORE_MIN_GROUP * max(1, num_kv_heads)
    if value not in ("0", "1"):
        raise ValueError(f"BULLET_RAY_DECODE_TENSOR_CORES must be 0 or 1, got {value!r}")
    return value == "1"


# decode plans of this many rows or more are split by `balanced_kv_chunk_pages` (only the longest rows, into even
# chunks; none when the rows are alike) instead of by flashinfer's planner, which from ~33 rows splits none and
# below that splits every row. On the H100 (benchmarks/results/decode_attention_h100, decode_attention_skew_h100),
# graph mode: with every row at one context, no split was 1-7% faster than flashinfer's from 16 rows (one row of
# 4k: 4.5x slower); with rows drawn from the conversation trace, as served, flashinfer's split was 2x faster than
# none at 8-16 rows and the balanced one beat both from 24 rows (24: 64 us a layer vs 72-86; 32-64: 0.74-0.82 of
# the copy bandwidth vs 0.59-0.77; 128 rows with one of 14k: 0.86 vs 0.66) and equalled no split where no row
# stands out. From 16 rows since the fifteenth session (benchmarks/results/lease_m2s, lease_m2s2): 16 rows x 8 KV
# heads already fill the GPU's SMs once, and with rows alike flashinfer's split then cost 18% (16 x 1k: 37.7 us a
# layer vs 32.0 unsplit, which the balanced rule picks for rows alike); on served lengths the balanced split equals
# or beats flashinfer's at 12-24 rows; at 8 rows alike (64 CTAs) flashinfer's split still pays (16.6 vs 21.9 us),
# so the limit stays above that
SPLIT_KV_MAX_ROWS = 16


# the smallest KV chunk a balanced split makes (pages of 16 tokens: 256 tokens), so a chunk's partial output and
# its merge stay small next to the KV it reads
MIN_SPLIT_PAGES = 16
# CTAs flashinfer's FA2 planner gives each SM (its `num_blocks_per_sm`)
_CTAS_PER_SM = 2
# of the shared workspace, what a split's partial outputs may take (the rest: indices, LSE, the prefill kernel's)
_SPLIT_WORKSPACE_SHARE = 0.5


def _decode_cta_tile_q(group: int) -> int:
    """The query tile of decode rows whose `group` query heads share a KV head (flashinfer's FA2DetermineCtaTileQ
    for a packed length of `group`: 16 up to 16 rows, 64 up to 64, else 128)."""
    return 16 if group <= 16 else (64 if group <= 64 else 128)


def graph_grid_chunks(num_rows: int, num_heads: int, num_kv_heads: int, num_sms: int) -> int:
    """How many (row, KV chunk) work items the tensor-core decode plan of a `num_rows`-row CUDA-graph bucket
    holds: flashinfer pads its grid to max(2 x SMs / KV heads, query tiles of the ragged worst case) and a plan
    whose chunks exceed it fails; from ~33 rows that is about 1.25 x the rows (GQA groups up to 16)."""
    group = max(1, num_heads // max(1, num_kv_heads))
    tiles = -(-num_rows * group // _decode_cta_tile_q(group)) + num_rows - 1
    return max(_CTAS_PER_SM * num_sms // max(1, num_kv_heads), tiles)


def workspace_chunks(num_heads: int, num_kv_heads: int, head_dim: int, workspace_bytes: int = WORKSPACE_BYTES) -> int:
    """How many KV chunks a split decode plan may have before its partial outputs (float32, one query tile of
    every KV head per chunk) outgrow their share of the workspace; a split that needs more goes without."""
    group = max(1, num_heads // max(1, num_kv_heads))
    per_chunk = max(1, num_kv_heads) * _decode_cta_tile_q(group) * head_dim * 4
    return int(workspace_bytes * _SPLIT_WORKSPACE_SHARE) // per_chunk


def balanced_kv_chunk_pages(pages: Sequence[int], num_kv_heads: int, num_sms: int,
                            max_chunks: int | None = None) -> int | None:
    """The KV chunk (pages) of a decode plan that splits only the batch's longest rows, or None: no split.

    flashinfer's tensor-core decode runs one CTA per (row, KV head) and from ~33 rows splits no row's KV (its
    planner fills 2 x SMs CTAs and stops), so in a served batch (a few rows of 4-14k context beside many of
    ~1k) the longest rows' CTAs run on after the others are done: the kernel read the KV at 0.57-0.72 of the
    copy bandwidth at 32-64 such rows against 0.81-0.87 with every row alike
    (benchmarks/results/decode_attention_skew_h100). The chunk is the batch's fair share of one CTA slot (its
    pages x KV heads over 2 x SMs, at least MIN_SPLIT_PAGES), grown until the chunks fit `max_chunks`
    (`FlashInferBackend.split_chunk_cap`: what the workspace and a CUDA graph's padded grid hold; None: no
    limit). None when no row is longer than one and a half chunks or than one and a half times the batch's
    mean (nothing to even out: with 16 rows alike the chunk is half a row, and splitting every row in two read
    the KV slower than no split, benchmarks/results/lease_m2s), or when not even unsplit rows fit."""
    if not pages:
        return None
    longest = max(pages)
    if longest * 2 * len(pages) <= 3 * sum(pages):
        return None  # no row stands out
    chunk = max(MIN_SPLIT_PAGES, -(-sum(pages) * num_kv_heads // (_CTAS_PER_SM * max(1, num_sms))))
    if longest * 2 <= chunk * 3:
        return None
    if max_chunks is not None:
        rows = np.maximum(np.asarray(pages, dtype=np.int64), 1)  # the host plans every step: ~10 us, not a loop

        def fits(c: int) -> bool:
            return int((-(-rows // c)).sum()) <= max_chunks

        if not fits(longest):
            return None  # not even unsplit rows fit
        low, high = chunk, longest
        while low < high:  # the smallest chunk from the fair share up whose pieces fit the grid
            mid = (low + high) // 2
            low, high = (low, mid) if fits(mid) else (mid + 1, high)
        chunk = low
        if longest * 2 <= chunk * 3:
            return None
    return chunk


KV_WRITE_MODES = ("append", "scatter")


def _one_of(name: str, value: str, modes: Sequence[str]) -> str:
    """`value`, when it is one of `modes`; else a ValueError naming the setting (`name`) and its modes."""
    if value not in modes:
        raise ValueError(f"{name} must be one of {', '.join(modes)}, got {value!r}")
    return value


def default_kv_write() -> str:
    """How new K/V go into the paged pool unless a backend is told otherwise, from BULLET_RAY_KV_WRITE: "append"
    (default: flashinfer's paged append kernel) or "scatter" (torch's `index_put_`, the path before the forty-second
    session: one thread per 2-byte element, 1.69x the time of vLLM's `reshape_and_cache_flash` per prompt token on
    the H200, benchmarks/results/kernel_compare_h200/)."""
    return _one_of("BULLET_RAY_KV_WRITE", os.environ.get("BULLET_RAY_KV_WRITE", "append"), KV_WRITE_MODES)


def default_prefill_attention() -> str:
    """How prompt rows attend unless a backend is told otherwise, from BULLET_RAY_PREFILL_ATTENTION: "ragged"
    (default: the prompt rows after the batch's last chunk with a cached prefix, which all start their prompts,
    through flashinfer's ragged prefill over the step's own K/V rows, contiguous tokens instead of 16-token pages;
    the rows up to that chunk stay paged, `split_fresh_rows`) or "paged" (every prompt chunk through the paged
    prefill kernel, reading K/V from the pool). At an 8,192-token budget on the H200 a prompt token's attention
    cost 1.46x vLLM's FlashAttention-3 varlen kernel paged and 1.19x ragged, offline 0.970x -> 0.976x vLLM's
    requests/s (benchmarks/results/kernel_compare_h200/ kc8192_m17, offline_h200_m17)."""
    return _one_of("BULLET_RAY_PREFILL_ATTENTION", os.environ.get("BULLET_RAY_PREFILL_ATTENTION", "ragged"),
                   PREFILL_ATTENTION_MODES)


def split_fresh_rows(query_lens: Sequence[int], seq_lens: Sequence[int]) -> int:
    """How many leading prompt rows go through the paged kernel when the rest run ragged: every row up to the last
    one with a cached prefix (seq_len > query_len); the rows after it start their prompts, so their K/V are all in
    the step. Rows keep their order (one contiguous range per kernel), so a fresh row before a continuing one
    stays paged (correct, only not ragged)."""
    last = -1
    for i, (q, n) in enumerate(zip(query_lens, seq_lens)):
        if n > q:
            last = i
    return last + 1


class AppendIndex:
    """Where flashinfer's paged append kernel writes a batch's tokens, from the slot mapping alone: every token is a
    request of one page (`indptr` = 0, 1, ..., n; the token's own batch index; its page `slot // block_size`, its
    entry `slot % block_size`). The kernel's page arithmetic (indptr[b] * block_size + entry, split by block_size)
    then lands on the slot: no per-request lengths, no host sync, and a CUDA graph captures it as it is."""

    def __init__(self, slot_mapping: torch.Tensor, block_size: int, into: WriteIndexBuffers | None = None) -> None:
        """`into`: write the index into these buffers' leading rows (a CUDA graph whose later pieces read it, or
        another partition's graphs of the same step) instead of new tensors."""
        slots = slot_mapping.to(torch.int32)
        n = slots.shape[0]
        if into is None:
            self.indptr = torch.arange(n + 1, dtype=torch.int32, device=slots.device)
            self.pages = torch.div(slots, block_size, rounding_mode="floor")
            self.positions = slots - self.pages * block_size
        else:
            into.check_fits(n)
            self.indptr, self.pages, self.positions = into.indptr[:n + 1], into.pages[:n], into.positions[:n]
            torch.div(slots, block_size, rounding_mode="floor", out=self.pages)
            torch.sub(slots, self.pages * block_size, out=self.positions)
        self.batch_indices = self.indptr[:-1]  # token i is request i (a contiguous prefix view)
        self.last_page_len = self.indptr[1:]  # the kernel reads only the request count from it


class WriteIndexBuffers:
    """Fixed buffers for a batch's K/V write index, for up to `max_rows` tokens: the paged append's (`AppendIndex`:
    `indptr` = 0, 1, ..., max_rows, made once; pages, positions) and the scatter's (`kv_rows`: each token's K and V
    rows). A backend told to use them (`FlashInferBackend.write_index_buffers`) derives each batch's index into them:
    a decode step captured in pieces derives it in its first piece and the later pieces, of whichever partition,
    read it there (bullet_ray.engine.cuda_graphs)."""

    def __init__(self, max_rows: int, device: torch.device | str) -> None:
        self.max_rows = max_rows
        self.indptr = torch.arange(max_rows + 1, dtype=torch.int32, device=device)
        self.pages = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.kv_rows = torch.zeros(max_rows, 2, dtype=torch.int64, device=device)

    def check_fits(self, num_tokens: int) -> None:
        if num_tokens > self.max_rows:
            raise ValueError(f"{num_tokens} tokens to index, the write-index buffers hold {self.max_rows}")


# how a mixed batch (decode rows first, then prompt chunks) runs its attention
MIXED_ATTENTION_MODES = ("split", "overlap", "holistic")


def default_mixed_attention() -> str:
    """How a mixed batch's attention runs unless a backend is told otherwise, from BULLET_RAY_MIXED_ATTENTION:

    - "split" (default): its decode rows through the decode kernel, then its prompt chunks through the prefill
      kernel (flashinfer's SM90 one on Hopper), one after the other;
    - "overlap": the same two kernels, the decode rows on a second stream beside the prompt chunks' kernel;
    - "holistic": every row in ONE launch of flashinfer's persistent `BatchAttention` (FA2-style tiles: 128-row
      tiles for prompt chunks, 16-row tiles for decode rows' packed query heads, KV split across CTAs by a cost
      model), as vLLM's FlashAttention-3 runs a mixed batch in one varlen kernel.

    The two kernels of "split" are bound by different things (reading the decode rows' KV; the prompt tiles'
    arithmetic), which vLLM's one kernel overlaps: +1.9 ms of attention on a full 2,048-token mixed step against
    vLLM's (benchmarks/results/kernel_compare_steps_h100/). On the H100 (benchmarks/results/
    mixed_attention_holistic_h100/) "overlap" is 1.00-1.13x split on the chunked schedule's step shapes and +0.5%
    offline; "holistic" is 1.07x on a fresh full chunk but 0.81x on a full chunk after a long prefix (its FA2-style
    prompt tiles lose to the SM90 prefill kernel), 1.00x in serving at a 2,048-token budget and -18% offline at
    16,384: so "split" stays the default. Only a batch launched on the default stream overlaps (a green context's
    stream keeps its SMs)."""
    if "BULLET_RAY_MIXED_ATTENTION_OVERLAP" in os.environ:  # the twentieth session's name: say so, not ignore it
        raise ValueError("BULLET_RAY_MIXED_ATTENTION_OVERLAP is gone: set BULLET_RAY_MIXED_ATTENTION=overlap "
                         "(or split, holistic) instead")
    return _one_of("BULLET_RAY_MIXED_ATTENTION", os.environ.get("BULLET_RAY_MIXED_ATTENTION", "split"),
                   MIXED_ATTENTION_MODES)


def mps_thread_cap() -> str | None:
    """This process's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE when it caps the SMs (below 100: gpu.partition's reading);
    else None."""
    value = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "").strip()
    return value if value and mps_thread_percentage() < 100 else None


def default_decode_split_kv_rows() -> int | None:
    """From how many rows on a tensor-core decode plan is split by `balanced_kv_chunk_pages` (None: never, below
    it and at any batch flashinfer splits as it chooses; 0: no plan splits), from BULLET_RAY_DECODE_SPLIT_KV:
    "auto" (default: SPLIT_KV_MAX_ROWS), "1" (flashinfer's split at any batch: None) or "0" (never split: 0).
    flashinfer's own plan splits differently in CUDA-graph mode (always, chunks from the padded grid) and
    eagerly (from the real lengths), so graph and eager decode of a long row can round differently where it
    splits (benchmarks/gpu/decode_split_check.py measures both); a balanced split is the same in both unless the
    graph's grid makes its chunk larger."""
    value = os.environ.get("BULLET_RAY_DECODE_SPLIT_KV", "auto")
    if value not in ("auto", "0", "1"):
        raise ValueError(f"BULLET_RAY_DECODE_SPLIT_KV must be auto, 0 or 1, got {value!r}")
    return {"auto": SPLIT_KV_MAX_ROWS, "0": 0, "1": None}[value]


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    # a mixed batch's leading decode rows through the decode kernel (False: every row through the prefill
    # kernel, as before; benchmarks/gpu/mixed_attention.py compares the two)
    split_mixed_batches = True
    # on while cuda_graphs.DecodeGraphs without a scratch slot captures a bucket of more than one row: its
    # padding rows share row 0's slot, and row 0's K/V are written after the others' (`store_first_row_last`)
    first_row_writes_last = False
    # mixed_attention "holistic": the one-kernel attention of a mixed batch (None in the other modes)
    holistic: HolisticAttention | None = None
    holistic_fallbacks = 0
    # kv_write "append": flashinfer's page module and the batch's index into it (None: the scatter writes)
    _append_module: Any = None
    _append_index: AppendIndex | None = None
    # where each batch's K/V write index is derived (None: new tensors per batch); set while DecodeGraphs captures a
    # decode step in pieces
    write_index_buffers: WriteIndexBuffers | None = None
    # prefill_attention "ragged": flashinfer's ragged prefill wrapper; the batch's tokens before the prompt rows that
    # run ragged (decode rows and the rows up to the last chunk with a cached prefix, which the paged kernels run),
    # None when no row runs ragged
    ragged: Any = None
    _ragged_from: int | None = None

    def __init__(self, kv_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float, decode_tensor_cores: bool | None = None, mixed_attention: str | None = None,
                 kv_write: str | None = None, prefill_attention: str | None = None) -> None:
        super().__init__(kv_cache, num_heads, num_kv_heads, head_dim, scale)
        import flashinfer

        device = kv_cache.device
        self.decode_tensor_cores = default_decode_tensor_cores(num_heads, num_kv_heads) if decode_tensor_cores is None \
            else decode_tensor_cores
        self.decode_split_kv_rows = default_decode_split_kv_rows()
        # the device's SMs as flashinfer's planner counts them (a green context's stream does not change it)
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.kv_write = default_kv_write() if kv_write is None else _one_of("kv_write", kv_write, KV_WRITE_MODES)
        # flashinfer's page module (JIT-built at its first load: here, at start, not mid-serving); None: scatter
        self._append_module = _load_append_module() \
            if self.kv_write == "append" and append_serves(head_dim, kv_cache.dtype) else None
        self.mixed_attention = default_mixed_attention() if mixed_attention is None \
            else _one_of("mixed_attention", mixed_attention, MIXED_ATTENTION_MODES)
        overlap = self.mixed_attention == "overlap"
        # overlapped, a mixed step's two kernels run at once: the decode wrapper then gets a workspace of its own
        # (each wrapper lays out its partial outputs from the buffer's start) and the decode rows a side stream
        decode_workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device) if overlap \
            else self.workspace
        self._side_stream = torch.cuda.Stream(device) if overlap else None
        # holistic: every row of a mixed batch in one persistent kernel (its own workspaces: flashinfer's 384 MiB);
        # not under an MPS thread percentage below 100: its cooperative grid is sized for every SM of the device
        cap = mps_thread_cap() if self.mixed_attention == "holistic" else None
        if cap is not None:
            logger.warning("mixed_attention holistic needs every SM; under CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%s mixed "
                           "batches run split", cap)
        self.holistic = HolisticAttention(device, num_heads, num_kv_heads, head_dim, kv_cache.dtype, scale) \
            if self.mixed_attention == "holistic" and cap is None else None
        self._holistic_planned = False
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD")
        self.prefill_attention = default_prefill_attention() if prefill_attention is None \
            else _one_of("prefill_attention", prefill_attention, PREFILL_ATTENTION_MODES)
        self.ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, kv_layout="NHD") \
            if self.prefill_attention == "ragged" else None
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(decode_workspace, kv_layout="NHD",
                                                                    use_tensor_cores=self.decode_tensor_cores)
        self.fence = PlanFence()
        self.holistic_fallbacks = 0  # mixed batches the holistic planner refused (they ran split)
        if self.holistic is not None:  # load its module now (its first plan syncs the device), not mid-serving
            try:
                self.fence.plan(self.holistic, _pinned([0, 1, 3]), _pinned([0, 1, 2]), _pinned([1, 2]),
                                torch.zeros(2, dtype=torch.int32, device=device), kv_cache.shape[3])
            except RuntimeError:  # e.g. a model whose KV heads outgrow the planner's workspace: every plan would fail
                logger.warning("mixed_attention holistic cannot plan for this model; mixed batches run split",
                               exc_info=True)
                self.holistic = None
        self._is_decode = False
        self._num_decode_rows = 0  # a mixed batch's leading decode rows (run by the decode kernel)
        # rows of the new tokens' K and V in a layer viewed as [num_blocks * 2 * block_size, kv_heads, head_dim],
        # computed from the slot mapping at the first layer of each batch (`_rows_md` is that batch)
        self._rows_md: AttentionMetadata | None = None
        self._kv_rows: torch.Tensor | None = None
        self._layer_rows: list[torch.Tensor] = []
        self._layer_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.bind_layer_views()
        self._direct: dict[int, DirectRun] = {}  # per wrapper (id): its planned run, layer after layer

    def bind_layer_views(self) -> None:
        """Per layer, made once (a view costs the host microseconds, 32+ times a step): the layer's K and V
        halves as flashinfer reads them, and its rows [num_blocks * 2 * block_size, kv_heads, head_dim] for
        the K/V write."""
        caches = list(self.kv_cache)  # per layer [num_blocks, K/V, block_size, kv_heads, head_dim]
        self._layer_rows = [c.view(-1, c.shape[-2], c.shape[-1]) for c in caches]
        self._layer_kv = [(c[:, 0], c[:, 1]) for c in caches]  # what flashinfer would unbind

    def begin_batch(self, metadata: AttentionMetadata) -> None:
        bs = metadata.block_size
        seq_lens = metadata.seq_lens_list
        num_blocks = [(n + bs - 1) // bs for n in seq_lens]
        dev = self.kv_cache.device
        tables = metadata.block_tables
        if all(n == tables.shape[1] for n in num_blocks):
            kv_indices = tables.reshape(-1).to(torch.int32)
        else:  # the first num_blocks[i] entries of row i, gathered without a host sync
            width = tables.shape[1]
            flat = [i * width + j for i, n in enumerate(num_blocks) for j in range(n)]
            kv_indices = tables.reshape(-1).index_select(0, to_device(flat, torch.int64, dev)).to(torch.int32)
        last_page_len = [(n - 1) % bs + 1 for n in seq_lens]
        self._is_decode = metadata.is_decode
        self._rows_md = None
        self._ragged_from = None
        # a mixed batch's leading one-token rows (the chunked schedule puts its decodes first) go to the
        # decode kernel: in the prefill kernel each would fill a whole query tile of its own
        if metadata.is_decode:
            nd = len(seq_lens)
        else:
            nd = _num_leading_ones(metadata.query_lens_list) if self.split_mixed_batches else 0
        self._num_decode_rows = 0 if metadata.is_decode else nd
        # holistic: decode rows and prompt chunks in one kernel, only on the default stream: the persistent kernel is
        # a cooperative launch sized for every SM of the device, which a green context's partition does not hold
        self._holistic_planned = False
        if nd and not metadata.is_decode and self.holistic is not None and _on_default_stream(dev):
            try:
                self.fence.plan(self.holistic, _pinned([0, *_cumsum(metadata.query_lens_list)]),
                                _pinned([0, *_cumsum(num_blocks)]), _pinned(seq_lens), kv_indices, bs)
            except RuntimeError:  # past the planner's limits (65,536 work items, its KV-split cap): split this step
                self.holistic_fallbacks += 1
                if self.holistic_fallbacks == 1:
                    logger.warning("holistic attention could not plan a mixed batch of %d rows; it runs split "
                                   "(counted in holistic_fallbacks)", len(seq_lens), exc_info=True)
            else:
                self._holistic_planned = True
                return
        first_prefill_block = sum(num_blocks[:nd])
        if nd:
            self._plan_decode(num_blocks[:nd], kv_indices[:first_prefill_block], last_page_len[:nd], bs)
        if metadata.is_decode:
            return
        query_lens = metadata.query_lens_list[nd:]
        paged = split_fresh_rows(query_lens, seq_lens[nd:]) if self.ragged is not None else len(query_lens)
        if paged == len(query_lens):  # every prompt row through the paged kernel (the default)
            self._plan_prefill(query_lens, num_blocks[nd:], kv_indices[first_prefill_block:], last_page_len[nd:], bs)
            return
        if paged:  # the rows up to the last one with a cached prefix
            self._plan_prefill(query_lens[:paged], num_blocks[nd:nd + paged],
                               kv_indices[first_prefill_block:first_prefill_block + sum(num_blocks[nd:nd + paged])],
                               last_page_len[nd:nd + paged], bs)
        self._plan_ragged(query_lens[paged:])
        self._ragged_from = nd + sum(query_lens[:paged])

    def decode_plan_options(self, pages: Sequence[int], graph_rows: int | None = None) -> dict[str, Any]:
        """Extra arguments of a decode plan over rows of `pages` KV pages each, eager or (`graph_rows`: its bucket,
        the padded rows counted in `pages`) in a CUDA graph (tensor-core kernel only): from `decode_split_kv_rows`
        rows on, the balanced split (`fixed_split_size`; no split where no row stands out); with the limit at 0
        no split at all; else flashinfer's own."""
        limit, num_rows = self.decode_split_kv_rows, len(pages)
        if not self.decode_tensor_cores or limit is None or num_rows < limit:
            return {}
        chunk = None
        if limit > 0:
            chunk = balanced_kv_chunk_pages(pages, self.num_kv_heads, self.num_sms, self.split_chunk_cap(graph_rows))
        return {"disable_split_kv": True} if chunk is None else {"fixed_split_size": chunk}

    def split_chunk_cap(self, graph_rows: int | None = None) -> int:
        """The most KV chunks a balanced split may make: what the workspace holds (`workspace_chunks`) and, for a
        CUDA graph's bucket of `graph_rows`, what its padded grid holds (`graph_grid_chunks`)."""
        cap = workspace_chunks(self.num_heads, self.num_kv_heads, self.head_dim)
        if graph_rows is not None:
            cap = min(cap, graph_grid_chunks(graph_rows, self.num_heads, self.num_kv_heads, self.num_sms))
        return cap

    def _plan_decode(self, num_blocks: list[int], kv_indices: torch.Tensor, last_page_len: list[int], bs: int) -> None:
        dtype = self.kv_cache.dtype
        self.fence.plan(self.decode, _pinned([0, *_cumsum(num_blocks)]), kv_indices, _pinned(last_page_len),
                        self.num_heads, self.num_kv_heads, self.head_dim, bs, q_data_type=dtype,
                        kv_data_type=dtype, sm_scale=self.scale, **self.decode_plan_options(num_blocks))

    def _plan_prefill(self, query_lens: list[int], num_blocks: list[int], kv_indices: torch.Tensor,
                      last_page_len: list[int], bs: int) -> None:
        dtype = self.kv_cache.dtype
        self.fence.plan(self.prefill, _pinned([0, *_cumsum(query_lens)]), _pinned([0, *_cumsum(num_blocks)]),
                        kv_indices, _pinned(last_page_len), self.num_heads, self.num_kv_heads, self.head_dim, bs,
                        causal=True, q_data_type=dtype, kv_data_type=dtype, sm_scale=self.scale)

    def _plan_ragged(self, query_lens: list[int]) -> None:
        """Plan the fresh prompt rows (no cached prefix: each attends causally over its own tokens) for the ragged
        kernel, which reads K/V from the step's rows instead of the pool."""
        dtype = self.kv_cache.dtype
        indptr = _pinned([0, *_cumsum(query_lens)])
        self.fence.plan(self.ragged, indptr, indptr, self.num_heads, self.num_kv_heads, self.head_dim, causal=True,
                        q_data_type=dtype, kv_data_type=dtype, sm_scale=self.scale)

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Store the batch's new K/V of one layer at their slots."""
        if self._rows_md is not metadata:
            self._rows_md, self._kv_rows, self._append_index = metadata, None, None
        bs = self.kv_cache.shape[3]  # [layers, num_blocks, K/V, block_size, kv_heads, head_dim]
        if (self._append_module is not None and not self.first_row_writes_last and k.dtype == self.kv_cache.dtype
                and v.dtype == k.dtype and k.stride(-1) == 1 and v.stride(-1) == 1 and k.shape[0] > 0):
            if self._append_index is None:
                self._append_index = AppendIndex(metadata.slot_mapping, bs, self.write_index_buffers)
            index = self._append_index
            k_cache, v_cache = self._layer_kv[layer]
            self._append_module.append_paged_kv_cache(k, v, index.batch_indices, index.positions, k_cache, v_cache,
                                                      index.pages, index.indptr, index.last_page_len, _NHD)
            return
        rows = self._layer_rows[layer]
        if self._kv_rows is None:
            slots = metadata.slot_mapping
            k_rows = slots + torch.div(slots, bs, rounding_mode="floor") * bs
            into = self.write_index_buffers
            if into is None:
                self._kv_rows = torch.stack((k_rows, k_rows + bs), dim=1)  # [tokens, 2]: the K row, the V row
            else:
                into.check_fits(slots.shape[0])
                self._kv_rows = into.kv_rows[:slots.shape[0]]
                torch.stack((k_rows, k_rows + bs), dim=1, out=self._kv_rows)
        kv = _adjacent_kv(k, v)
        if self.first_row_writes_last and len(self._kv_rows) > 1:  # a decode graph's padded batch
            if kv is None or kv.dtype != rows.dtype:
                kv = torch.stack((k, v), dim=1).to(rows.dtype)
            store_first_row_last(rows, self._kv_rows, kv)
        elif kv is not None and kv.dtype == rows.dtype:
            rows.index_put_((self._kv_rows,), kv)
        else:
            rows.index_copy_(0, self._kv_rows[:, 0], k.to(rows.dtype))
            rows.index_copy_(0, self._kv_rows[:, 1], v.to(rows.dtype))

    def forget_batch(self) -> None:
        """Drop what was derived from the last batch's metadata (a CUDA graph capture must recompute it)."""
        self._rows_md = None

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        self.write_kv(layer, k, v, metadata)
        k_cache, v_cache = self._layer_kv[layer]
        # both kernels take q's token and head strides (q is a view of the fused qkv rows: no copy)
        if q.stride(-1) != 1:
            q = q.contiguous()
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self._is_decode:
            return self._run(self.decode).run(q, k_cache, v_cache, out)
        if self._holistic_planned and self.holistic is not None:
            return self.holistic.run(q, k_cache, v_cache, out)
        if self._ragged_from is not None:
            return self._forward_ragged(q, k, v, k_cache, v_cache, out)
        nd = self._num_decode_rows
        if not nd:
            return self._run(self.prefill).run(q, k_cache, v_cache, out)
        side = self._side_stream
        if side is None or not _on_default_stream(q.device):
            self._run(self.decode).run(q[:nd], k_cache, v_cache, out[:nd])
            self._run(self.prefill).run(q[nd:], k_cache, v_cache, out[nd:])
            return out
        main = torch.cuda.current_stream(q.device)
        side.wait_stream(main)  # this layer's q and K/V write are in
        with torch.cuda.stream(side):
            self._run(self.decode).run(q[:nd], k_cache, v_cache, out[:nd])
        self._run(self.prefill).run(q[nd:], k_cache, v_cache, out[nd:])
        main.wait_stream(side)  # later work on the main stream (and reuse of q / out's memory) waits for both
        return out

    def _forward_ragged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """A batch whose last prompt rows (from token `_ragged_from`, all starting their prompts) run ragged over
        their own K/V rows: the decode rows and the prompt rows before them through their paged kernels, one after
        the other."""
        nd, start = self._num_decode_rows, self._ragged_from
        assert start is not None and self.ragged is not None
        if nd:
            self._run(self.decode).run(q[:nd], k_cache, v_cache, out[:nd])
        if start > nd:
            self._run(self.prefill).run(q[nd:start], k_cache, v_cache, out[nd:start])
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            k, v = k.contiguous(), v.contiguous()
        self._run(self.ragged).run(q[start:], k[start:], v[start:], out[start:])
        return out

    def _run(self, wrapper: Any) -> DirectRun:
        direct = self._direct.get(id(wrapper))
        if direct is None or direct.wrapper is not wrapper:
            direct = self._direct[id(wrapper)] = DirectRun(wrapper, lambda: self.fence.plan_count(wrapper), PDL,
                                                           ragged=wrapper is self.ragged)
        return direct


class PlanFence:
    """Plans a flashinfer wrapper again only after the GPU has taken its previous plan.

    `plan` writes the schedule into the wrapper's page-locked host buffer and queues a copy of it on the
    stream; rewriting that buffer before the queued copy has run would hand the step still waiting on the
    GPU the next step's schedule. An event recorded after each plan is waited on before the wrapper's next
    one: the host stays at most one step ahead."""

    def __init__(self) -> None:
        self._copied: dict[int, torch.cuda.Event] = {}
        self._plans: dict[int, int] = {}

    def plan(self, wrapper: Any, *args: Any, **kwargs: Any) -> float:
        """Plan `wrapper` once the GPU has taken its previous plan; returns the seconds the host waited for that."""
        return self.plan_by(wrapper, lambda: wrapper.plan(*args, **kwargs))

    def plan_by(self, wrapper: Any, plan: Callable[[], Any]) -> float:
        """`plan` with another planner of `wrapper` (one that fills the same page-locked buffer and queues its copy:
        `DirectDecodePlan`); returns the seconds the host waited for the wrapper's previous plan."""
        previous = self._copied.get(id(wrapper))
        waited = 0.0
        if previous is not None:
            began = time.perf_counter()
            previous.synchronize()
            waited = time.perf_counter() - began
        self._plans[id(wrapper)] = self._plans.get(id(wrapper), 0) + 1  # before: a failed plan is stale too
        plan()
        event = torch.cuda.Event()
        event.record()
        self._copied[id(wrapper)] = event
        return waited

    def plan_count(self, wrapper: Any) -> int:
        """How many times this wrapper was planned (a DirectRun's record holds for one plan)."""
        return self._plans.get(id(wrapper), 0)


DECODE_PLAN_MODES = ("wrapper", "direct")


def default_decode_plan() -> str:
    """How a decode graph's bucket is planned again, from BULLET_RAY_DECODE_PLAN: "wrapper" (default: the wrapper's
    `plan`) or "direct" (`DirectDecodePlan`, opt-in until the GPU test of tests/gpu/test_decode_plan_gpu.py has
    passed on a lease)."""
    value = os.environ.get("BULLET_RAY_DECODE_PLAN", "wrapper")
    if value not in DECODE_PLAN_MODES:
        raise ValueError(f"BULLET_RAY_DECODE_PLAN must be one of {', '.join(DECODE_PLAN_MODES)}, got {value!r}")
    return value


class DirectDecodePlan:
    """A CUDA-graph decode wrapper's plan again without the wrapper's Python: its compiled planner called directly,
    as `HolisticAttention` and `DirectRun` do for theirs.

    In the H200 lease m24 the attention plan held the decode host 0.8-1.1 ms a step from 16 rows on (a split plan
    is made again whenever a row's page count changes; `graph_plan_ms` in benchmarks/results/serve_h200_m24), and
    that host time sat inside the 32-piece switch's slow cases. flashinfer 0.7.2's `_plan_impl` (read in its
    wheel) spends it before its planner: buffer and backend checks, three copies into the wrapper's page-table
    buffers (DecodeGraphs' own staged copy filled them already: the buffers are the graphs'), and the KV lengths
    recomputed by torch ops. For the tensor-core kernel on flashinfer's fa2 path, once a first `plan` has resolved
    the wrapper's backend and compiled module, this calls that module's `plan` with the arguments `_plan_impl`
    passes (the batch's one-token query indptr, the page indptr, the KV lengths in tokens, CUDA-graph mode, no
    causal mask or window, the split options) and keeps its result as the wrapper's `_plan_info`. The planner
    fills the wrapper's page-locked buffer and queues its copy, so `PlanFence.plan_by` guards it like a wrapper's
    own. Anything else (the CUDA-core kernel, fa3, cuDNN, a wrapper not yet planned) is left to the wrapper
    (`serves`)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim, self.page_size = num_heads, num_kv_heads, head_dim, page_size
        self._query_indptr: dict[int, torch.Tensor] = {}  # per batch size: 0..b, one token a row
        self._kv_lens: dict[int, torch.Tensor] = {}  # per batch size: the planner's KV lengths in tokens

    @staticmethod
    def serves(wrapper: Any) -> bool:
        """Whether `wrapper` can be planned directly: a CUDA-graph, tensor-core wrapper on the fa2 path that a
        `plan` has already set up (its compiled module loaded, and what its `run` reads, e.g. `_sm_scale`, set: only
        once a planner has returned; a first plan the planner refused leaves it unset), one token a row, not routed
        to cuDNN."""
        return (bool(getattr(wrapper, "use_tensor_cores", False))
                and bool(getattr(wrapper, "is_cuda_graph_enabled", False))
                and getattr(wrapper, "_backend", None) == "fa2"
                and getattr(wrapper, "_cached_module", None) is not None
                and hasattr(wrapper, "_sm_scale")
                and not getattr(wrapper, "_cudnn_auto", False)
                and getattr(wrapper, "_q_len_per_req", 1) == 1)

    def __call__(self, wrapper: Any, indptr: torch.Tensor, last_page_len: torch.Tensor,
                 fixed_split_size: int | None = None, disable_split_kv: bool = False) -> None:
        """Plan `wrapper` for rows of `indptr` (pages, a CPU int32 tensor of b + 1) and `last_page_len` (CPU int32,
        b): what its own `plan` would compute, with these split options."""
        b = len(last_page_len)
        query_indptr = self._query_indptr.get(b)
        if query_indptr is None:
            query_indptr = self._query_indptr[b] = torch.arange(b + 1, dtype=torch.int32)
            self._kv_lens[b] = torch.zeros(b, dtype=torch.int32)
        kv_lens = self._kv_lens[b]
        pages = indptr.numpy()
        out = kv_lens.numpy()  # flashinfer's get_seq_lens: (pages - 1, at least 0) x page size + the last page's
        np.maximum(pages[1:] - pages[:-1] - 1, 0, out=out)
        out *= self.page_size
        out += last_page_len.numpy()
        wrapper._plan_info = wrapper._cached_module.plan(
            wrapper._float_workspace_buffer, wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer,
            query_indptr, indptr, kv_lens, b, b, self.num_heads, self.num_kv_heads, self.page_size, True,
            self.head_dim, self.head_dim, False, -1, -1 if fixed_split_size is None else fixed_split_size,
            disable_split_kv, 0, 0)


_NHD = 0  # flashinfer's TensorLayout.NHD: the pool's layout
_APPEND_HEAD_DIMS = (64, 128, 256, 512)  # what AppendPagedKVCache's launcher dispatches


def append_serves(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether flashinfer's paged append can write a pool of this head size and dtype: its launcher dispatches head
    sizes 64-512 and half precision; anything else keeps the scatter."""
    return head_dim in _APPEND_HEAD_DIMS and dtype in (torch.float16, torch.bfloat16)


def _load_append_module() -> Any:
    """flashinfer's page module (its `append_paged_kv_cache` called directly: the public wrapper's custom-op dispatch
    and int() casts cost the host microseconds 32+ times a step), or None where it cannot load (the scatter serves)."""
    try:
        from flashinfer.page import get_page_module

        module = get_page_module()
        module.append_paged_kv_cache  # noqa: B018 - an old flashinfer without it: scatter
    except Exception:  # noqa: BLE001 - a build or load failure leaves the scatter, which needs nothing
        logger.warning("flashinfer's paged append kernel did not load; K/V are written by index_put_", exc_info=True)
        return None
    return module


def store_first_row_last(rows: torch.Tensor, kv_rows: torch.Tensor, kv: torch.Tensor) -> None:
    """Write K/V rows `kv` [tokens, 2, kv_heads, head_dim] at `kv_rows` [tokens, 2], the first token's last.

    Without a scratch slot a decode graph's padding rows (cuda_graphs.padded_rows) repeat row 0's slot, but
    from the second layer on their K/V differ from row 0's (they attend over one token, row 0 over its context). In one `index_put_`
    duplicate indices leave either value (undefined which): row 0 could read, and keep in the cache, a
    padding row's K/V for its own token. Rows 1.. first, then row 0 alone: row 0's K/V stay. Rows 1.. hold
    no other duplicates (real rows have slots of their own, padding rows only row 0's)."""
    rows.index_put_((kv_rows[1:],), kv[1:])
    rows.index_put_((kv_rows[:1],), kv[:1])


def _adjacent_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """k and v [tokens, kv_heads, head_dim] as one [tokens, 2, kv_heads, head_dim] view when v starts right
    after k in every token's row (the split of a fused qkv projection) with the same layout; else None."""
    if k.shape != v.shape or k.stride() != v.stride() or k.dtype != v.dtype or k.stride(-1) != 1:
        return None
    if k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr():  # two tensors that merely sit side by side
        return None
    tokens, heads, dim = k.shape
    if k.stride(1) != dim or v.data_ptr() != k.data_ptr() + heads * dim * k.element_size():
        return None
    return k.as_strided((tokens, 2, heads, dim), (k.stride(0), heads * dim, dim, 1))


def _on_default_stream(device: torch.device) -> bool:
    """Whether work is being launched on the device's default stream, which every SM serves (a green context's
    stream holds its partition's): the condition of both mixed-attention modes beyond "split"."""
    return torch.cuda.current_stream(device).cuda_stream == torch.cuda.default_stream(device).cuda_stream


def _num_leading_ones(values: list[int]) -> int:
    """How many values at the front are 1 (rows of a single query token)."""
    n = 0
    while n < len(values) and values[n] == 1:
        n += 1
    return n


def _pinned(values: list[int]) -> torch.Tensor:
    """An int32 CPU tensor in page-locked memory (flashinfer copies it to the device without a sync)."""
    return torch.tensor(values, dtype=torch.int32).pin_memory()


def _cumsum(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out
