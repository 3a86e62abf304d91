"""Green-context partitions on a real GPU: capabilities, granted SM counts, streams usable by torch with
correct results, and the real effect: the SM ids kernels ran on (via the nvcc-built probe) and the slowdown
of a compute-bound GEMM on a small partition; two sides run together on disjoint SMs."""

from __future__ import annotations

import pytest
import torch

from bullet_ray.errors import ConfigError

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from bullet_ray.gpu import nvml, probe, smctl  # noqa: E402
from bullet_ray.gpu.partition import make_partitioner  # noqa: E402

needs_probe = pytest.mark.skipif(not probe.available(), reason="the SM-id probe needs nvcc")
SMS = torch.cuda.get_device_properties(0).multi_processor_count


@pytest.fixture(scope="module")
def pair():
    torch.zeros(1, device="cuda")
    p = make_partitioner("green", "both", 0, [16, 64, 112])
    yield p
    p.close()


def _gemm_ms(stream, a, b, iters=10) -> float:
    with torch.cuda.stream(stream):
        for _ in range(3):
            a @ b
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            a @ b
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def test_capabilities():
    caps = smctl.capabilities(0)
    assert caps.sm_count == SMS and caps.green_ctx_supported and caps.reason == ""
    assert caps.driver_version >= 12040 and caps.granularity >= 1
    assert nvml.sm_count(0) in (None, SMS)
    assert nvml.gpu_uuid(0) is None or nvml.gpu_uuid(0).startswith("GPU-")


def test_ladder_grants_complementary_counts(pair):
    caps = smctl.capabilities(0)
    assert pair.name == "green" and pair.is_switchable
    for e, asked in zip(pair.ladder, [16, 64, 112]):
        assert e.decode_sms >= asked and e.decode_sms % caps.granularity == 0
        assert e.decode_sms + e.prefill_sms == SMS
    assert all(isinstance(pair.stream(i, s), torch.cuda.Stream) for i in range(3) for s in ("decode", "prefill"))
    assert pair.select(2) is True and pair.select(2) is False


def test_results_on_a_green_stream_equal_the_default_stream(pair):
    a = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1024, 768, device="cuda", dtype=torch.bfloat16)
    ref = a @ b
    s = pair.stream(0, "decode")
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = a @ b
    s.synchronize()
    assert torch.equal(out, ref)


def test_one_side_per_process():
    p = make_partitioner("green", "decode", 0, [32])
    try:
        assert p.stream(0, "decode") is not None
        with pytest.raises(ConfigError, match="'decode' side only"):
            p.stream(0, "prefill")
    finally:
        p.close()


@needs_probe
def test_a_ladder_floor_of_one_granule_is_granted():
    """engine.decode_sm_counts may start the ladder at one granule (serve_h100's -fl8: 8 decode SMs on Hopper, prefill
    on the rest): the entry is granted as asked and kernels on each side run on exactly its SMs."""
    caps = smctl.capabilities(0)
    floor = caps.granularity
    p = make_partitioner("green", "both", 0, [floor, 2 * floor])
    try:
        assert [e.decode_sms for e in p.ladder] == [floor, 2 * floor]
        d, q = probe.sm_ids(p.stream(0, "decode")), probe.sm_ids(p.stream(0, "prefill"))
        assert len(d) == floor and len(q) == SMS - floor and not d & q
    finally:
        p.close()


def test_bad_counts_are_typed_errors():
    with pytest.raises(ConfigError, match=str(SMS)):
        make_partitioner("green", "decode", 0, [SMS])
    g = smctl.capabilities(0).granularity
    if g > 1:  # two counts inside one group round up to the same split
        with pytest.raises(ConfigError, match="two entries would be one split"):
            make_partitioner("green", "decode", 0, [g + 1, g + 2])
    with pytest.raises(smctl.InvalidArgumentError, match="device 99"):
        smctl.capabilities(99)


@needs_probe
def test_kernels_run_on_the_granted_sms_only(pair):
    sets = {(e.index, side): probe.sm_ids(pair.stream(e.index, side)) for e in pair.ladder
            for side in ("decode", "prefill")}
    for e in pair.ladder:
        d, p = sets[(e.index, "decode")], sets[(e.index, "prefill")]
        assert len(d) == e.decode_sms and len(p) == e.prefill_sms  # every granted SM used, no other
        assert not d & p and len(d | p) == SMS
    # nested: a smaller decode group is part of a larger one (what the switch protocol relies on)
    assert sets[(0, "decode")] <= sets[(1, "decode")] <= sets[(2, "decode")]
    assert len(probe.sm_ids(torch.cuda.current_stream())) == SMS


def test_small_partition_is_proportionally_slower(pair):
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16)
    full = _gemm_ms(torch.cuda.current_stream(), a, b)
    small = _gemm_ms(pair.stream(0, "decode"), a, b)  # 16 of 132 SMs
    assert small / full > 0.5 * SMS / pair.ladder[0].decode_sms  # measured ~6.7x of an ideal 8.25x


def test_two_sides_together_barely_slow_each_other(pair):
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 8192, device="cuda", dtype=torch.bfloat16)
    d, p = pair.stream(1, "decode"), pair.stream(1, "prefill")
    alone = _gemm_ms(d, a, b, 20)
    with torch.cuda.stream(p):  # keep the prefill side busy for the whole decode measurement
        for _ in range(60):
            a @ b
    together = _gemm_ms(d, a, b, 20)
    torch.cuda.synchronize()
    assert together / alone < 1.6  # disjoint SMs: shared power/L2/memory only (overlapping: ~1.9x)

