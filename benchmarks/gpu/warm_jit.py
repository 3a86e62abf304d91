"""Build flashinfer's JIT kernels the engine uses (paged prefill, CUDA-core decode, paged K/V append, norm,
SiLU-and-mul, rotary) in parallel processes, so the benchmarks that follow find them in FLASHINFER_WORKSPACE_BASE.

    python -m benchmarks.gpu.warm_jit
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time


def _attention(kind: str) -> None:
    import torch

    from bullet_ray.engine.attention.base import AttentionMetadata, get_backend_class

    kv = torch.randn(1, 8, 2, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
    be = get_backend_class("flashinfer")(kv, 8, 2, 128, 128 ** -0.5)
    q_len = 1 if kind == "decode" else 20
    md = AttentionMetadata(torch.tensor([0, q_len], dtype=torch.int32, device="cuda"),
                           torch.tensor([20], dtype=torch.int32, device="cuda"),
                           torch.tensor([[0, 1]], dtype=torch.int32, device="cuda"),
                           torch.arange(20 - q_len, 20, device="cuda"), [q_len], [20], 16, kind == "decode")
    be.begin_batch(md)
    q = torch.randn(q_len, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(q_len, 2, 128, device="cuda", dtype=torch.bfloat16)
    be.forward(0, q, k, k.clone(), md)
    torch.cuda.synchronize()


def _layers() -> None:
    import torch

    from bullet_ray.models import gpu_kernels
    from bullet_ray.models.layers import RotaryEmbedding

    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    assert gpu_kernels.rms_norm(x, torch.ones(256, device="cuda", dtype=torch.bfloat16), 1e-5) is not None
    assert gpu_kernels.silu_and_mul(x) is not None
    rot = RotaryEmbedding(128, 10000.0, None, "cuda")
    q = torch.randn(4, 8, 128, device="cuda", dtype=torch.bfloat16)
    assert gpu_kernels.rope_inplace(rot, torch.arange(4, device="cuda"), q, q[:, :2].clone()) is not None
    torch.cuda.synchronize()


def _job(name: str) -> None:
    start = time.monotonic()
    if name == "layers":
        _layers()
    else:
        _attention(name)
    print(f"warm {name}: {time.monotonic() - start:.1f} s", flush=True)


def main() -> int:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_job, args=(n,)) for n in ("prefill", "decode", "layers")]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
