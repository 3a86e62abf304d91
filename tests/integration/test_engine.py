"""The engine end to end on CPU: worker processes, shared weights and KV, HF-identical greedy output.

References are Hugging Face transformers' greedy `generate` in float32 on the same weights. Every engine
here starts real worker processes (spawn), so each module keeps the number of engines small.
"""

from __future__ import annotations

import json
import os
import time
from importlib.resources import files
from pathlib import Path

import pytest
import torch
import yaml

from bullet_ray.config import EngineConfig
from bullet_ray.engine.llm_engine import LLMEngine
from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.errors import InvalidRequest

pytestmark = pytest.mark.slow

FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"]
PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 250, 11], [300, 2, 71], list(range(40, 77)), [9] * 5 + [13, 14]]
NUM_NEW = 24


def _hf_folder(preset: str, root) -> str:
    """A Hugging Face folder with random weights for a tiny preset, written by transformers itself."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = os.path.join(root, preset)
    if not os.path.exists(folder):
        config = AutoConfig.for_model(**_preset(preset))
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(folder)
    return folder


def _preset(preset: str) -> dict:
    """The HF config of a tiny preset; Mistral is the Llama preset under Mistral's architecture."""
    name = "tiny-llama" if preset == "tiny-mistral" else preset
    cfg = json.loads((files("bullet_ray.models") / "presets" / f"{name}.json").read_text())
    if preset == "tiny-mistral":
        cfg.pop("rope_scaling", None)
        cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None)
    return cfg


def _hf_greedy(hf_greedy, folder: str, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return [hf_greedy(model, ids, num_new) for ids in prompts]


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf_models"))


@pytest.mark.parametrize("schedule", ["bullet", "chunked"])
@pytest.mark.parametrize("preset", FAMILIES)
def test_greedy_matches_transformers(preset, schedule, hf_root, hf_greedy):
    folder = _hf_folder(preset, hf_root)
    expected = _hf_greedy(hf_greedy, folder, PROMPTS, NUM_NEW)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    # a small token budget forces chunked prompts and mixed batches in the chunked schedule
    config = EngineConfig(model=folder, schedule=schedule, num_kv_blocks=64, block_size=4,
                          max_num_batched_tokens=16)
    with LLMEngine(config) as engine:
        assert engine.stats().predicted_ttft_s is None  # no prefill step measured yet
        results = engine.generate(PROMPTS, params)
        stats = engine.stats()
        assert stats.num_free_kv_blocks == 64
        # measured prefill steps give a prediction; an idle engine's is about one step of an average prompt
        assert stats.predicted_ttft_s is not None and 0 < stats.predicted_ttft_s < 5
        if preset == "tiny-llama":  # generate checks the whole list before it sends any (one message for all)
            with pytest.raises(InvalidRequest) as bad:
                engine.generate([PROMPTS[0], [10**9]], params)
            assert bad.value.field == "prompt"
            stats = engine.stats()
            assert (stats.num_waiting, stats.num_running, stats.num_free_kv_blocks) == (0, 0, 64)
            assert [r.token_ids for r in engine.generate(PROMPTS[:1], params)] == expected[:1]
    assert [r.token_ids for r in results] == expected


def test_stats_report_the_decoding_sides_recent_step_time(hf_root):
    folder = _hf_folder("tiny-llama", hf_root)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with LLMEngine(EngineConfig(model=folder, num_kv_blocks=64, block_size=4)) as engine:
        assert engine.stats().recent_decode_step_s is None  # nothing decodes yet
        seen = []
        for i, _ in enumerate(engine.stream(list(range(3, 20)), params)):
            if i >= 5:  # decoding: what admission_tpot_s compares with the TPOT target
                seen.append(engine.stats().recent_decode_step_s)
        assert len(seen) > 20 and all(s is not None and 1e-4 < s < 5 for s in seen[5:15]), seen
        assert engine.stats().recent_decode_step_s is None  # idle again


def test_sequences_without_a_decode_slot_count_as_waiting(hf_root):
    """Bullet schedule, decode batches of 1: three prompts are prefilled at once and handed to decode, which runs
    one of them at a time. The two without a slot wait (admission's max_waiting_per_engine and the router see
    them), not run."""
    import threading

    folder = _hf_folder("tiny-llama", hf_root)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    with LLMEngine(EngineConfig(model=folder, num_kv_blocks=64, block_size=4, max_num_seqs=1)) as engine:
        done = []
        threads = [threading.Thread(target=lambda p=p: done.append(list(engine.stream(p, params))))
                   for p in ([5, 6, 7], [8, 9, 10], [11, 12, 13])]
        for t in threads:
            t.start()
        seen = []
        while any(t.is_alive() for t in threads):
            stats = engine.stats()
            seen.append((stats.num_waiting, stats.num_running))
            time.sleep(0.005)
        for t in threads:
            t.join()
        final = engine.stats()
    assert len(done) == 3 and (final.num_waiting, final.num_running) == (0, 0)
    assert all(w + r <= 3 for w, r in seen)
    assert (2, 1) in seen, sorted(set(seen))  # one decoding, two prefilled and waiting for the slot


def test_pool_too_small_preempts_and_still_matches(hf_root, hf_greedy):
    folder = _hf_folder("tiny-llama", hf_root)
    prompts = [list(range(10 + i, 30 + i)) for i in range(6)]
    expected = _hf_greedy(hf_greedy, folder, prompts, 20)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    # 6 requests x 40 tokens need 60 blocks of 4; the pool has 24
    config = EngineConfig(model=folder, num_kv_blocks=24, block_size=4, kv_watermark=0.0)
    with LLMEngine(config) as engine:
        results = engine.generate(prompts, params)
        stats = engine.stats()
        assert stats.num_free_kv_blocks == 24
        assert stats.num_preemptions > 0
    assert [r.token_ids for r in results] == expected


@pytest.mark.parametrize("schedule", ["chunked", "bullet"])
def test_prompts_chunked_part_way_do_not_stall_a_small_pool(schedule, hf_root, hf_greedy):
    """Prompts prefilled in 8-token chunks hold their blocks while they wait; a pool that holds one request at a
    time must still finish all (a waiting prompt's KV goes to the head once nothing runs) with HF's tokens."""
    folder = _hf_folder("tiny-llama", hf_root)
    prompts = [list(range(100 + 7 * i, 130 + 7 * i)) for i in range(3)]
    expected = _hf_greedy(hf_greedy, folder, prompts, 20)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    # each request needs 13 blocks of 4 (30 + 20 tokens); the pool has 16
    config = EngineConfig(model=folder, schedule=schedule, num_kv_blocks=16, block_size=4, max_model_len=64,
                          max_num_batched_tokens=8, kv_watermark=0.0)
    with LLMEngine(config) as engine:
        results = engine.generate(prompts, params)
        stats = engine.stats()
        assert stats.num_free_kv_blocks == 16
        assert stats.num_preemptions > 0  # counted under either schedule (the chunked one's in its worker)
    assert [r.token_ids for r in results] == expected


def _slo_policy_run(hf_root, hf_greedy, tmp_path, num_new: int = NUM_NEW, num_kv_blocks: int = 64, **extra):
    """(config, HF's greedy tokens, params, step log) of the tiny Llama on the bullet schedule with the SLO split
    policy and a TPOT target no CPU step meets: whenever both sides are busy, decode must get the most SMs."""
    folder = _hf_folder("tiny-llama", hf_root)
    expected = _hf_greedy(hf_greedy, folder, PROMPTS, num_new)
    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
    log = tmp_path / "steps.jsonl"
    config = EngineConfig(model=folder, num_kv_blocks=num_kv_blocks, block_size=4, max_num_batched_tokens=16,
                          split_policy="slo", tpot_target_ms=1e-3, step_log_path=str(log), **extra)
    return config, expected, params, log


@pytest.mark.parametrize("split_switch,async_scheduling", [("disjoint", None), ("overlap", True)])
def test_split_policy_moves_the_split_and_keeps_the_tokens(hf_root, hf_greedy, tmp_path, split_switch,
                                                           async_scheduling):
    """The bullet schedule with the model-driven split policy (forced on for CPU, where partitions change
    nothing): the prefill worker decides at its step boundaries, both workers follow, every step is
    predicted and recorded, and the tokens stay HF's; in overlap mode too, where a side moves with a step
    still in flight (launching ahead)."""
    config, expected, params, log = _slo_policy_run(hf_root, hf_greedy, tmp_path, split_switch=split_switch,
                                                    async_scheduling=async_scheduling)
    with LLMEngine(config) as engine:
        results = engine.generate(PROMPTS, params)
        deadline = time.monotonic() + 10  # the last switch settles at the workers' next loop
        while time.monotonic() < deadline and len(set(engine.split_indexes().values())) > 1:
            time.sleep(0.02)
        stats = engine.stats()
        drained = engine.drain_step_records()
        assert stats.num_free_kv_blocks == 64
    assert [r.token_ids for r in results] == expected
    policy, split = stats.extra["policy"], stats.extra["split"]
    top = len(split["decode_sms"]) - 1
    # the first prompt finds decode idle: all to prefill (index 0), a switch both sides completed
    assert policy["num_decisions"] > 0 and policy["num_switches"] >= 1
    assert 0 < policy["last_switch_us"] < 5_000_000
    # every decision counted under its reason (the bullet_split_decisions_total counter's source)
    assert sum(policy["decisions_by_reason"].values()) == policy["num_decisions"]
    assert policy["decisions_by_reason"].get("only_prefill", 0) >= 1
    # admission and the router read the model's predicted TTFT, published by the prefill worker
    assert stats.predicted_ttft_s == pytest.approx(policy["predicted_ttft_us"] / 1e6) and stats.predicted_ttft_s > 0
    # ... for a typical prompt, and how it grows per prompt token (admission moves it to a request's length)
    assert stats.predicted_ttft_prompt_tokens == policy["predicted_ttft_tokens"] > 0
    assert policy["predicted_ttft_ns_per_token"] > 0
    assert stats.ttft_per_prompt_token_s == pytest.approx(policy["predicted_ttft_ns_per_token"] / 1e9)
    assert stats.predicted_ttft_for(stats.predicted_ttft_prompt_tokens) == stats.predicted_ttft_s
    records = [json.loads(line) for line in log.read_text().splitlines()]
    # each worker's start-up once, before any other record: each writes its own before its Ready (in either order:
    # the front starts decode at prefill's handles, before prefill's graphs), and no request is sent before both;
    # prefill's one decision while decode starts is IDLE, which is not logged
    startups = [r for r in records if r["kind"] == "startup"]
    assert sorted(r["role"] for r in startups) == ["decode", "prefill"] and records[:2] == startups
    assert all(r["seconds"]["total"] >= r["seconds"]["resources"] > 0 for r in startups)
    # each side names the profile its model starts from: the package's CPU profile of the tiny model, measured
    assert all(r["perf_model"].startswith("cpu__tiny-llama__float32.json (measured, ") for r in startups), startups
    # the prefill worker (it creates the shared memory) sent its handles before its graphs; decode sends none
    by_role = {r["role"]: r for r in startups}
    assert 0 < by_role["prefill"]["handles_after_s"] <= by_role["prefill"]["seconds"]["total"]
    assert "handles_after_s" not in by_role["decode"]
    # each froze its heap once started (engine.gc_freeze, the default): the objects moved out of the collector's reach
    assert all(r["gc_frozen"] > 1000 and r["seconds"]["gc_freeze"] >= 0 for r in startups), startups
    # and each worker's collections so far reach the front in its state-block row (the gc_pause_seconds metric)
    gc_totals = stats.extra["gc"]
    assert set(gc_totals) == {"prefill", "decode"}, gc_totals
    assert all(t["collections"] >= 0 and t["seconds"] >= 0 for t in gc_totals.values()), gc_totals
    first = [r for r in records if r["kind"] == "first_token"]  # written by the prefill worker
    assert len({r["request_id"] for r in first}) == len(first) == len(PROMPTS)
    decisions = [r for r in records if r["kind"] == "decision"]
    assert decisions[0]["reason"] == "only_prefill" and decisions[0]["index"] == 0
    for d in decisions:
        if d["decode_seqs"] > 0 and d["num_queued"] > 0:
            assert d["index"] == top and d["reason"] == "to_decode"
    switched = [r for r in records if r["kind"] == "switch"]  # one per switch both sides completed
    assert switched and all(0 < r["decision_to_split_us"] < 5_000_000 for r in switched)
    # and how much of each the acking worker spent in garbage collections (bullet_ray.engine.gc_pauses)
    assert all(0 <= r["gc_ms"] <= r["decision_to_split_us"] / 1e3 for r in switched)
    assert all(r["overlap"] == (split_switch == "overlap") for r in switched)
    # each switch takes effect once no step of either side runs on the old entry (the last may still wait)
    drains = [r for r in records if r["kind"] == "switch_drained"]
    assert drains and all(0 < r["decision_to_drained_us"] < 5_000_000 for r in drains)
    for drain in drains:  # after its switch's acks (the two sides write their records in either order), no quicker
        acked = [r for r in switched if r["t"] <= drain["t"] + 0.05 and r["index"] == drain["index"]]
        assert acked and drain["decision_to_drained_us"] >= acked[-1]["decision_to_split_us"]
    assert policy["num_drains"] == len(drains)
    assert policy["num_drains"] + policy["num_drains_overtaken"] <= policy["num_switches"]
    steps = [r for r in records if r["kind"] == "step"]
    assert {r["side"] for r in steps} == {"prefill", "decode"}
    assert all(r["predicted_ms"] > 0 and r["measured_ms"] > 0 for r in steps)
    # each step's launch began before it was recorded, on the records' clock (plot_steps.launch_phase reads it)
    assert all(r["t"] - 60 < r["launch_began_t"] <= r["t"] for r in steps)
    assert sum(r["num_tokens"] for r in steps if r["side"] == "prefill") == sum(len(p) for p in PROMPTS)
    if split_switch == "disjoint":  # every step collected before its side moved: each ran on one entry
        assert not any(r["across_switch"] for r in steps)
    assert drained["decode"] and all(m > 0 and p > 0 for m, p, _ in drained["decode"])
    assert drained["switch_s"] and all(0 < t < 5 for t in drained["switch_s"])
    assert drained["switch_drain_s"] and all(0 < t < 5 for t in drained["switch_drain_s"])
    # every request was handed to decode once (no preemption in this pool): each hand-off timed, drained once
    assert len(drained["handoff_s"]) == len(PROMPTS) and all(0 <= t < 5 for t in drained["handoff_s"])


def test_a_configured_ladder_is_the_one_the_workers_and_the_policy_use(hf_root, hf_greedy, tmp_path):
    """engine.decode_sm_counts replaces the default ladder (16 ... 112 on 132 SMs) in both workers, the front and the
    split policy: its decisions and steps name only the configured entries (8 decode SMs the floor), and the tokens
    stay HF's. Decode runs 600 tokens: a prefill side that went idle before decode started (its last decisions saw
    decode idle) decides again only when it wakes (at most every half second, once decode has published a step),
    and a CI run under load saw 24-token streams end before that."""
    config, expected, params, log = _slo_policy_run(hf_root, hf_greedy, tmp_path, num_new=600, num_kv_blocks=1024,
                                                    decode_sm_counts=[8, 40, 100])
    with LLMEngine(config) as engine:
        assert engine.ladder_decode_sms == [8, 40, 100] and engine.split_ladder_size() == 3
        results = engine.generate(PROMPTS, params)
        stats = engine.stats()
    assert [r.token_ids for r in results] == expected
    assert stats.extra["split"]["decode_sms"] == [8, 40, 100]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    decisions = [r for r in records if r["kind"] == "decision"]
    assert decisions[0]["reason"] == "only_prefill" and decisions[0]["index"] == 0  # decode idle: prefill on 124
    assert any(d["index"] == 2 for d in decisions)  # a TPOT target no CPU step meets: decode on the top entry
    steps = [r for r in records if r["kind"] == "step"]
    assert steps and {(r["decode_sms"], r["prefill_sms"]) for r in steps} <= {(8, 124), (40, 92), (100, 32)}


def test_an_idle_prefill_worker_decides_after_decode_steps_with_idle_decide(hf_root, hf_greedy, tmp_path):
    """engine.prefill_idle_decide_ms: a prefill worker that has run dry wakes that often while decode runs and decides
    the split again after decode's steps (without it, on a message or every 0.5 s): one prompt, then decode alone,
    and a decision with nothing queued and decode running moves decode to the top entry (a TPOT target no CPU step
    meets) within a short stream; the tokens stay HF's."""
    config, expected, params, log = _slo_policy_run(hf_root, hf_greedy, tmp_path, num_new=48, num_kv_blocks=1024,
                                                    decode_sm_counts=[8, 40, 100], prefill_idle_decide_ms=2)
    with LLMEngine(config) as engine:
        results = engine.generate(PROMPTS[:1], params)
    assert [r.token_ids for r in results] == expected[:1]
    decisions = [json.loads(line) for line in log.read_text().splitlines()]
    decisions = [r for r in decisions if r["kind"] == "decision"]
    assert decisions[0]["reason"] == "only_prefill" and decisions[0]["index"] == 0
    assert any(d["reason"] == "only_decode" and d["index"] == 2 and d["num_queued"] == 0 and d["decode_seqs"] == 1
               for d in decisions), decisions


def _shipped_policy() -> dict:
    """The GPU deployment's planning fields (deploy/gpu.yaml, read so the test follows it): what serve_h100's
    -mx<tokens> runs the mixed fallback beside."""
    gpu_yaml = Path(__file__).resolve().parents[2] / "deploy" / "gpu.yaml"
    engine = yaml.safe_load(gpu_yaml.read_text())["applications"][0]["args"]["engine"]
    return {key: engine[key] for key in ("ttft_margin_ms", "prefill_order", "ttft_fallback_ms")}


SHIPPED_POLICY = _shipped_policy()


@pytest.mark.parametrize("handoff, policy", [("front", {}), ("direct", {}), ("direct", SHIPPED_POLICY)],
                         ids=["front", "direct", "direct-shipped-policy"])
def test_mixed_fallback_hands_prompts_to_decode_and_keeps_the_tokens(hf_root, hf_greedy, tmp_path, handoff, policy):
    """The bullet schedule's mixed fallback (`mixed_fallback_tokens: 1`: on whenever a prompt waits while
    decode runs), launching ahead (asynchronous scheduling): the prefill worker hands its queued prompts
    (partly prefilled ones too) to the decode worker, which prefills them in chunks inside its steps on the
    whole-GPU entry; the tokens stay HF's and every KV block comes back. With `handoff: direct` the prefilled
    sequences go to decode by the workers' own socket while the handed-over prompts still go through the front.
    The same beside the GPU deployment's policy fields (planning margin, max_on_time order, 1 s fallback target)."""
    folder = _hf_folder("tiny-llama", hf_root)
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]
    expected = _hf_greedy(hf_greedy, folder, prompts, NUM_NEW)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    log = tmp_path / "steps.jsonl"
    config = EngineConfig(model=folder, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
                          split_policy="slo", mixed_fallback_tokens=1, mixed_chunk_tokens=16, async_scheduling=True,
                          step_log_path=str(log), handoff=handoff, **policy)
    with LLMEngine(config) as engine:
        results = engine.generate(prompts, params)
        stats = engine.stats()
        assert stats.num_free_kv_blocks == 64
    assert [r.token_ids for r in results] == expected
    assert (stats.extra["handoff"]["num_direct"] > 0) == (handoff == "direct")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    mixed = [r for r in steps if r["phase"] == "mixed"]
    assert mixed and all(r["side"] == "decode" and r["num_tokens"] > r["num_seqs"] for r in mixed)
    assert all(r["predicted_ms"] > 0 for r in mixed)
    # on the whole-GPU entry decode has every SM and the prefill side never steps
    sm_count = stats.extra["split"]["decode_sms"][-1]
    assert any(r["decode_sms"] == sm_count and r["prefill_sms"] == 0 for r in mixed)
    assert all(r["prefill_sms"] > 0 for r in steps if r["side"] == "prefill")
    prefilled_here = sum(r["num_tokens"] for r in steps if r["side"] == "prefill")
    assert 0 < prefilled_here < sum(len(p) for p in prompts)  # the rest was prefilled by decode
    decisions = [r for r in records if r["kind"] == "decision"]
    assert any(d["reason"] == "mixed" and d["index"] == len(stats.extra["split"]["decode_sms"]) - 1
               for d in decisions)


def _generate_within(engine: LLMEngine, prompts, params, timeout_s: float):
    """`engine.generate`, failing the test instead of hanging when the engine stops scheduling (a stall)."""
    import threading

    done: dict = {}
    thread = threading.Thread(target=lambda: done.setdefault("results", engine.generate(prompts, params)),
                              daemon=True)
    thread.start()
    thread.join(timeout_s)
    if "results" not in done:
        pytest.fail(f"generate did not finish within {timeout_s} s: {engine.stats()}")
    return done["results"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_fallback_on_a_small_pool_finishes_with_the_tokens(async_scheduling, hf_root, hf_greedy):
    """The mixed fallback going on and off on a pool that holds one request at a time: prompts handed to the
    decode side (part-way ones too), preempted ones back through prefill. Every request ends with HF's tokens,
    every block comes back, and every prompt handed over left the decode side's hands (the prefill side plans
    nothing while any is held there, so the two sides never each hold a prompt part-way)."""
    folder = _hf_folder("tiny-llama", hf_root)
    prompts = [list(range(100 + 7 * i, 100 + 7 * i + n)) for i, n in enumerate([30, 22, 26, 30])]
    expected = _hf_greedy(hf_greedy, folder, prompts, 20)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    # each request needs up to 13 blocks of 4 (30 + 20 tokens); the pool has 16
    config = EngineConfig(model=folder, num_kv_blocks=16, block_size=4, max_model_len=64, max_num_batched_tokens=8,
                          kv_watermark=0.0, split_policy="slo", mixed_fallback_tokens=24, mixed_chunk_tokens=8,
                          async_scheduling=async_scheduling)
    with LLMEngine(config) as engine:
        results = _generate_within(engine, prompts, params, timeout_s=60)
        stats = engine.stats()
        assert stats.num_free_kv_blocks == 16
    assert [r.token_ids for r in results] == expected
    policy = stats.extra["policy"]
    assert policy["prompts_handed_over"] > 0  # the fallback ran
    assert policy["prompts_handed_over"] == policy["handed_prompts_done"] + policy["handed_prompts_dropped"]
    assert stats.num_preemptions > 0


def test_chunked_schedule_logs_every_step(hf_root, tmp_path):
    """The hybrid worker's step log: every prompt token and every decode token appears in exactly one
    step row, and a row's phase says what it held."""
    folder = _hf_folder("tiny-llama", hf_root)
    log = tmp_path / "steps.jsonl"
    config = EngineConfig(model=folder, schedule="chunked", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
                          step_log_path=str(log), gc_freeze=False)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    with LLMEngine(config) as engine:
        engine.generate(PROMPTS, params)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert {r["side"] for r in steps} == {"hybrid"}
    assert all(r["t"] - 60 < r["launch_began_t"] <= r["t"] for r in steps)
    # the worker's start-up, part by part, written once before any step
    (startup,) = [r for r in records if r["kind"] == "startup"]
    assert records[0] is startup and startup["role"] == "hybrid"
    assert set(startup["seconds"]) >= {"resources", "partitions", "total"}  # no graphs on CPU
    assert "gc_frozen" not in startup and "gc_freeze" not in startup["seconds"]  # gc_freeze off: no freeze
    # a step after garbage collections carries their time, count and oldest generation (none may have run)
    assert all(r["gc_ms"] > 0 and r["gc_count"] >= 1 and r["gc_gen"] in (0, 1, 2) for r in steps if "gc_count" in r)
    assert 0 < startup["seconds"]["resources"] <= startup["seconds"]["total"]
    # one first_token record per request: where its time to first token went inside the engine
    first = [r for r in records if r["kind"] == "first_token"]
    assert sorted(r["prompt_tokens"] for r in first) == sorted(len(p) for p in PROMPTS)
    assert len({r["request_id"] for r in first}) == len(PROMPTS)
    for r in first:
        assert r["to_worker_ms"] >= 0 and r["queue_ms"] >= 0 and r["prefill_ms"] > 0
        parts = r["to_worker_ms"] + r["queue_ms"] + r["prefill_ms"]
        assert abs(parts - r["worker_ttft_ms"]) < 0.01
    # each request's first token comes from its last prompt chunk; the other NUM_NEW - 1 from decode rows
    assert sum(r["num_tokens"] for r in steps) == sum(len(p) for p in PROMPTS) + len(PROMPTS) * (NUM_NEW - 1)
    assert {r["phase"] for r in steps} >= {"decode", "mixed"} and all(r["num_tokens"] <= 16 for r in steps)
    for r in steps:
        assert r["measured_ms"] > 0 and r["host_ms"] > 0
        assert (r["phase"] == "decode") == (r["num_prefill_seqs"] == 0)
        # the host's share: planning, inputs and metadata inside the launch, the gap since the last collect
        assert 0 < r["prep_ms"] < r["launch_ms"] and r["plan_ms"] > 0
        # the launch's parts: inputs and metadata, the forward enqueued, logits and sampling enqueued
        assert r["forward_ms"] > 0 and r["sample_ms"] > 0
        assert r["prep_ms"] + r["forward_ms"] + r["sample_ms"] <= r["launch_ms"] + 1e-3
        parts = [r[k] for k in ("sample_rows_ms", "logits_ms", "sampler_ms", "to_host_ms") if k in r]
        assert len(parts) in (0, 4) and sum(parts) <= r["sample_ms"] + 1e-3  # where sampling blocked, if it did
        assert r.get("gap_ms", r["plan_ms"]) >= r["plan_ms"]  # no gap after an idle wait
    assert sum("gap_ms" in r for r in steps) >= len(steps) - 2
    assert any("logits_ms" in r for r in steps)  # the sampling steps split their sample time
