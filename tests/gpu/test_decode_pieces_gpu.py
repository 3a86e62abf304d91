"""Decode steps in pieces on the GPU (`engine.decode_pieces`, bullet_ray.engine.cuda_graphs): a step captured as
several CUDA graphs of consecutive layers gives the hidden states and K/V of the whole-step graph and of eager
decode, launched all at once or just in time; a step that moves to another partition between two pieces (green
contexts where present, else plain streams) gives them too; and the bullet schedule with decode pieces keeps the
greedy tokens of the whole-step graphs while its decode steps record their pieces, also while splits requested every
2 ms move decode steps between their pieces.

Run: python -m pytest tests/gpu/test_decode_pieces_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.logged_run import run_logged
from tests.gpu.test_engine_gpu import _metadata, _tiny_model
from tests.split_requests import splits_requested

pytestmark = pytest.mark.gpu

SEQ_LENS = [5, 20, 33, 70, 1]


def _batch(n_layers: int, pieces: int, scratch: bool = True):
    from bullet_ray.engine.attention.base import get_backend_class
    from bullet_ray.engine.cuda_graphs import DecodeGraphs

    model, cfg = _tiny_model(n_layers)
    kv = torch.randn(cfg.num_hidden_layers, 64, 2, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
    backend = get_backend_class("flashinfer")(kv, 4, 2, 128, 128 ** -0.5)
    graphs = DecodeGraphs(model, backend, 16, 8, 32, torch.device("cuda"), scratch_slot=63 * 16 if scratch else None,
                          pieces=pieces)
    n = len(SEQ_LENS)
    md = _metadata([1] * n, SEQ_LENS)
    ids, pos = torch.arange(3, 3 + n, device="cuda"), torch.tensor([s - 1 for s in SEQ_LENS], device="cuda")
    tables, nxt = [], 0
    for s in SEQ_LENS:
        tables.append(list(range(nxt, nxt + (s + 15) // 16)))
        nxt += len(tables[-1])
    return model, backend, graphs, kv, md, ids, pos, tables


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("pieces", [2, 4])
def test_pieces_equal_the_whole_step_and_eager(pieces):
    """One graph per piece of layers (4 layers in 2 or 4 pieces): replayed at once or launched just in time
    (a hook that stays put), the hidden states and K/V equal eager decode's."""
    from bullet_ray.engine.attention.base import AttentionContext

    model, backend, graphs, kv, md, ids, pos, tables = _batch(4, pieces)
    assert graphs.pieces == pieces
    saved = kv.clone()
    calls = []
    with torch.inference_mode():
        backend.begin_batch(md)
        eager = model.forward(ids, pos, AttentionContext(backend, md))
        eager_kv = kv.clone()
        kv.copy_(saved)
        at_once = graphs.run(0, ids, pos, md, tables).clone()
        kv.copy_(saved)
        paced = graphs.run(0, ids, pos, md, tables, between=lambda: (calls.append(1), (0, None))[1]).clone()
    torch.cuda.synchronize()
    assert len(calls) == pieces - 1
    assert _rel(at_once, eager) < 1e-2 and _rel(paced, eager) < 1e-2
    own = slice(0, 63)
    assert _rel(kv[:, own], eager_kv[:, own]) < 1e-2
    assert all(len(g.pieces) == pieces for g in graphs.graphs.values())
    assert graphs.capture_report()["pieces"] == pieces and graphs.num_piece_moves == 0


@pytest.mark.parametrize("scratch", [True, False])
def test_a_step_that_moves_between_pieces_equals_eager(scratch):
    """The same bucket captured on two partitions (green contexts of 16 and 64 SMs where the native helper has
    them, else two plain streams). Partition 1 first runs a whole step of other sequences (other slots), then a step
    moves from partition 0 to partition 1 after its first piece: its hidden states and the K/V it writes equal
    eager's (the later pieces read the K/V write index the first piece derived into fixed buffers, not partition 1's
    from its last step), the rest of the step ran on partition 1's stream, and the move is counted. With a scratch
    slot (the paged append) and without (padding rows on row 0's slot: the scatter, row 0 written last)."""
    from bullet_ray.engine.attention.base import AttentionContext

    model, backend, graphs, kv, md, ids, pos, tables = _batch(4, 4, scratch)
    n = len(SEQ_LENS)
    used = sum(len(t) for t in tables)
    other_tables = [[used + i] for i in range(n)]  # one block each, after the batch's: other slots
    other_md = _metadata([1] * n, [1] * n)
    other_md.slot_mapping = torch.tensor([t[0] * 16 for t in other_tables], device="cuda")
    partitioner = None
    try:
        from bullet_ray.gpu.partition import GreenPartitioner

        partitioner = GreenPartitioner("decode", 0, [16, 64])
        streams = [partitioner.stream(0, "decode"), partitioner.stream(1, "decode")]
    except Exception:  # noqa: BLE001 - no green contexts here: the move's mechanics on two plain streams
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    try:
        for key, stream in enumerate(streams):
            graphs.capture_all(key, stream)
        graphs.is_serving = True
        saved = kv.clone()
        with torch.inference_mode():
            backend.begin_batch(md)
            eager = model.forward(ids, pos, AttentionContext(backend, md))
            eager_kv = kv.clone()
            kv.copy_(saved)
            with torch.cuda.stream(streams[1]):  # partition 1's graphs last wrote other slots
                graphs.run(1, ids + 7, torch.zeros_like(pos), other_md, other_tables)
            torch.cuda.synchronize()
            kv.copy_(saved)
            with torch.cuda.stream(streams[0]):
                moved = graphs.run(0, ids, pos, md, tables, between=lambda: (1, streams[1])).clone()
                last = torch.cuda.current_stream()
        torch.cuda.synchronize()
        assert last == streams[1]
        assert _rel(moved, eager) < 1e-2
        own = slice(0, used)
        assert _rel(kv[:, own], eager_kv[:, own]) < 1e-2  # every layer's new K/V where eager wrote them
        assert torch.equal(kv[:, used:63], saved[:, used:63])  # nothing written to the other step's slots
        assert graphs.num_piece_moves == 1 and graphs.num_captures_serving == 0 and graphs.num_piece_moves_missing == 0
    finally:
        if partitioner is not None:
            partitioner.close()


def _run(tmp_path, pieces: int):
    tokens, records, _ = run_logged(tmp_path / f"steps-{pieces}.jsonl", [[(7 * i + 13 * j) % 40000 + 100
                                                                          for j in range(n)]
                                                                         for i, n in enumerate([5, 600, 300, 17])],
                                    48, schedule="bullet", split_policy="slo", decode_pieces=pieces)
    return tokens, [r for r in records if r["kind"] == "step" and r["side"] == "decode"]


def test_bullet_schedule_with_decode_pieces_keeps_the_tokens(tmp_path):
    whole, _ = _run(tmp_path, 1)
    pieced, decode_steps = _run(tmp_path, 4)
    assert all(len(t) == 48 for t in pieced)
    same = sum(a == b for g, w in zip(pieced, whole) for a, b in zip(g, w))
    assert same / sum(len(w) for w in whole) >= 0.9  # bf16 near-ties of a dummy model aside
    assert decode_steps and all(r["layer_groups"] == 4 for r in decode_steps if r["graphs"] == "decode")


def test_bullet_schedule_moves_decode_steps_between_pieces(tmp_path):
    """Decode steps in 4 pieces while a thread asks for another split every 2 ms (green contexts): decode steps move
    between their pieces through the graphs (`moved_while_launching` with `graphs: decode`), the tokens agree with
    the whole-step run's, and every KV block comes back."""
    import json
    import time

    from bullet_ray.config import EngineConfig
    from bullet_ray.engine.llm_engine import LLMEngine
    from bullet_ray.engine.sampling_params import SamplingParams

    whole, _ = _run(tmp_path, 1)
    prompts = [[(7 * i + 13 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate([5, 600, 300, 17])]
    log = tmp_path / "steps-moving.jsonl"
    config = EngineConfig(model="dummy:smollm2-135m", device="cuda", kv_cache_memory_gb=1.0, max_num_seqs=16,
                          step_log_path=str(log), schedule="bullet", split_policy="slo", decode_pieces=4)
    with LLMEngine(config) as engine:
        with splits_requested(engine, 0.002):
            params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
            tokens = [o.token_ids for o in engine.generate(prompts, params)]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and engine.stats().num_free_kv_blocks != engine.stats().num_kv_blocks:
            time.sleep(0.05)
        stats = engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    same = sum(a == b for g, w in zip(tokens, whole) for a, b in zip(g, w))
    assert same / sum(len(w) for w in whole) >= 0.9  # bf16 near-ties of a dummy model aside
    records = [json.loads(line) for line in log.read_text().splitlines()]
    moved = [r for r in records if r["kind"] == "step" and r["side"] == "decode" and r.get("moved_while_launching")]
    assert any(r["graphs"] == "decode" for r in moved)
