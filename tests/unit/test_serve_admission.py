"""Admission control and the engine replica's request path over the mock engine (no Ray cluster)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from bullet_ray.engine.outputs import EngineStats
from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.errors import ConfigError
from bullet_ray.serve.admission import AdmissionSettings
from bullet_ray.serve.config import BulletAppConfig
from bullet_ray.serve.engine_deployment import EngineReplica, GenerateError
from bullet_ray.serve.mock_engine import MockEngine, mock_engine_factory


def _stats(waiting: int = 0, ttft_s: float | None = None) -> EngineStats:
    return EngineStats(waiting, 0, 10, 10, predicted_ttft_s=ttft_s)


def test_refuses_on_a_full_queue_or_a_predicted_ttft_over_the_bound():
    settings = AdmissionSettings(max_waiting_per_engine=4, admission_ttft_s=1.0, admission_margin=0.5)
    assert settings.refusal(_stats(3, 1.5)) is None  # 1.5 s <= 1.0 x (1 + 0.5)
    assert "4 requests waiting" in settings.refusal(_stats(4))
    assert "predicted TTFT 1.600 s" in settings.refusal(_stats(0, 1.6))
    assert settings.refusal(_stats(0, None)) is None  # no prediction yet: queue length only
    assert AdmissionSettings(4).refusal(_stats(0, 100.0)) is None  # no TTFT target


def test_refuses_while_decode_steps_run_over_the_tpot_bound():
    settings = AdmissionSettings(max_waiting_per_engine=4, admission_tpot_s=0.025, admission_margin=0.2)
    slow = EngineStats(0, 40, 10, 10, recent_decode_step_s=0.031)
    assert "decode steps take 31.0 ms, over the TPOT bound 30.0 ms" in settings.refusal(slow)
    assert settings.refusal(EngineStats(0, 40, 10, 10, recent_decode_step_s=0.029)) is None
    assert settings.refusal(EngineStats(0, 0, 10, 10)) is None  # nothing decodes: no step time
    with pytest.raises(ConfigError, match="admission_tpot_s"):
        AdmissionSettings(4, admission_tpot_s=0)


def test_engine_measures_wall_time_per_decode_step(monkeypatch):
    import threading
    import types

    from bullet_ray.engine import llm_engine
    from bullet_ray.engine.llm_engine import LLMEngine

    clock = [100.0]
    monkeypatch.setattr(llm_engine.time, "monotonic", lambda: clock[0])
    engine = types.SimpleNamespace(_lock=threading.Lock(), _decode_step_mark=None, _decode_step_avg_s=None)
    observe = LLMEngine._observe_decode_step
    assert observe(engine, {"step": 10}, True) is None  # the first call marks where the window starts
    clock[0] += 0.2
    assert observe(engine, {"step": 20}, True) == pytest.approx(0.020)  # 10 steps in 0.2 s
    clock[0] += 0.1
    assert observe(engine, {"step": 20}, True) == pytest.approx(0.020)  # no new step: the window grows
    clock[0] += 0.2
    assert observe(engine, {"step": 30}, True) == pytest.approx(0.025)  # 10 steps in 0.3 s, averaged with 0.020
    assert observe(engine, {"step": 31}, False) is None  # idle: forgotten
    assert engine._decode_step_mark is None


def test_runtime_update_names_unknown_and_bad_fields():
    settings = AdmissionSettings(4)
    assert settings.updated({"admission_ttft_s": 0.5}).admission_ttft_s == 0.5
    with pytest.raises(ConfigError, match="max_queue"):
        settings.updated({"max_queue": 3})
    with pytest.raises(ConfigError, match="admission_margin"):
        settings.updated({"admission_margin": -1})


def _run(replica: EngineReplica, prompt: str, max_tokens: int) -> list:
    async def go() -> list:
        return [o async for o in replica.generate({"prompt": prompt, "params": SamplingParams(max_tokens=max_tokens)})]

    return asyncio.run(go())


def test_replica_answers_429_until_reconfigured():
    cfg = BulletAppConfig(engine={"model": "mock"}, admission_ttft_s=1.0)
    replica = EngineReplica(cfg.model_dump(), mock_engine_factory(predicted_ttft_s=2.0))
    [refused] = _run(replica, "a b", 2)
    assert isinstance(refused, GenerateError) and refused.status == 429 and refused.retry_after_s == 1
    replica.reconfigure({"admission_ttft_s": 3.0})
    outs = _run(replica, "a b", 2)
    assert [o.text_delta for o in outs] == [" t2", " t3"] and outs[-1].finish_reason == "length"
    stats = replica.stats()
    assert stats["num_rejected_total"] == 1 and stats["num_requests_total"] == 2
    assert replica.record_routing_stats() == {"predicted_ttft_s": 2.0, "num_waiting": 0, "num_running": 0,
                                              "kv_usage": 0.0}


def test_replica_counts_slo_met_against_the_per_prompt_token_ttft():
    """The replica judges a finished request with its prompt's tokens: a first token after 60 ms meets
    max(1 ms, 20 ms x 10 prompt tokens) but not max(1 ms, 20 ms x 1 token)."""
    cfg = BulletAppConfig(engine={"model": "mock", "ttft_target_ms": 1.0, "ttft_target_ms_per_prompt_token": 20.0})
    replica = EngineReplica(cfg.model_dump(), mock_engine_factory(first_token_delay_s=0.06))
    counted: list[str] = []
    replica.metrics.slo_total = SimpleNamespace(inc=lambda n, tags: counted.append(tags["slo_met"]))
    _run(replica, " ".join(["w"] * 10), 1)
    _run(replica, "w", 1)
    assert counted == ["true", "false"]


def test_replica_maps_engine_errors_to_http_statuses():
    replica = EngineReplica(BulletAppConfig(engine={"model": "mock"}).model_dump(),
                            mock_engine_factory(max_model_len=8))
    [too_long] = _run(replica, "a b c d", 5)
    assert (too_long.status, too_long.param) == (413, "max_tokens")
    [empty] = _run(replica, "", 1)
    assert (empty.status, empty.param) == (400, "prompt")


def test_mock_engine_holds_kv_blocks_per_token_and_frees_them_on_abort():
    engine = MockEngine(num_kv_blocks=8, block_size=4, token_delay_s=0.01)

    async def go() -> tuple[int, int, str]:
        stream = engine.stream_async("a b c d e", SamplingParams(max_tokens=20), "r1")
        for _ in range(4):  # 5 prompt + 4 generated tokens: 3 blocks of 4
            await stream.__anext__()
        held = engine.num_kv_blocks - engine.stats().num_free_kv_blocks
        engine.abort("r1")
        last = [o async for o in stream][-1]
        return held, engine.stats().num_free_kv_blocks, last.finish_reason

    assert asyncio.run(go()) == (3, 8, "abort")
    outs = engine.generate(["x y"], SamplingParams(max_tokens=3))
    assert outs[0].token_ids == [2, 3, 4] and outs[0].text == " t2 t3 t4"


def test_per_prompt_token_ttft_bound_follows_the_requests_length():
    """Bullet's per-token targets: a request's bound is max(admission_ttft_s, ms per token x its prompt tokens)."""
    settings = AdmissionSettings(4, admission_ttft_s=0.5, admission_ttft_ms_per_prompt_token=2.0, admission_margin=0.1)
    assert settings.needs_prompt_tokens and not AdmissionSettings(4, admission_ttft_s=0.5).needs_prompt_tokens
    assert settings.ttft_bound_s(100) == pytest.approx(0.5 * 1.1)  # 0.2 s per-token target: the floor holds
    assert settings.ttft_bound_s(1000) == pytest.approx(2.0 * 1.1)
    assert settings.ttft_bound_s(None) == pytest.approx(0.5 * 1.1)  # length unknown: the fixed bound
    assert AdmissionSettings(4, admission_ttft_ms_per_prompt_token=2.0).ttft_bound_s(None) is None
    assert "over the bound 0.550 s" in settings.refusal(_stats(0, 1.0), 100)
    assert settings.refusal(_stats(0, 1.0), 1000) is None  # a long prompt may wait what its target allows
    with pytest.raises(ConfigError, match="admission_ttft_ms_per_prompt_token"):
        AdmissionSettings(4, admission_ttft_ms_per_prompt_token=0.0)
    assert settings.updated({"admission_ttft_ms_per_prompt_token": 3.0}).ttft_bound_s(1000) == pytest.approx(3.3)


def test_uncounted_prompt_gets_the_answer_every_length_gets():
    """When no length can change the answer (`length_decides` is False) the replica skips counting; the answer
    is then every length's, not the typical prompt's against the fixed bound alone."""
    # the typical 1,000-token prompt predicted 1.0 s, 1 ms per token more or less; bounds max(0.5 s, 2 ms x tokens):
    # every length is admitted (1 token: ~0.0 s <= 0.5; 1,000: 1.0 <= 2.0; longer: 1 ms/token under 2 ms/token)
    stats = EngineStats(0, 0, 10, 10, predicted_ttft_s=1.0, predicted_ttft_prompt_tokens=1000,
                        ttft_per_prompt_token_s=0.001)
    admit_all = AdmissionSettings(64, admission_ttft_s=0.5, admission_ttft_ms_per_prompt_token=2.0, admission_margin=0.0)
    assert not admit_all.length_decides(stats)
    assert all(admit_all.refusal(stats, n) is None for n in (1, 250, 1000, 10**6))
    assert admit_all.refusal(stats) is not None  # the typical prompt against 0.5 s alone: what used to answer
    assert admit_all.refusal_uncounted(stats) is None
    # a 5 s backlog at 2 ms per token against a bound of 1.5 ms per token only: every length is refused
    backlog = EngineStats(0, 0, 10, 10, predicted_ttft_s=5.0, predicted_ttft_prompt_tokens=1000,
                          ttft_per_prompt_token_s=0.002)
    refuse_all = AdmissionSettings(64, admission_ttft_ms_per_prompt_token=1.5, admission_margin=0.0)
    assert not refuse_all.length_decides(backlog)
    assert all(refuse_all.refusal(backlog, n) is not None for n in (1, 1000, 10**6))
    assert refuse_all.refusal(backlog) is None  # no fixed bound: the typical prompt's check admitted it
    assert "predicted TTFT" in refuse_all.refusal_uncounted(backlog)
    # without a per-token bound nothing changes: the typical prompt against the fixed bound
    fixed = AdmissionSettings(64, admission_ttft_s=0.5)
    assert fixed.refusal_uncounted(stats) == fixed.refusal(stats) is not None
    full = AdmissionSettings(2, admission_ttft_s=0.5, admission_ttft_ms_per_prompt_token=2.0)
    assert "2 requests waiting" in full.refusal_uncounted(EngineStats(2, 0, 10, 10, predicted_ttft_s=1.0))


class _AlternatingTemplate:
    """A chat template with its own checks (Llama-2 / Mistral style: user and assistant turns alternate)."""
    chat_template = "{% if ... %}{{ raise_exception('Conversation roles must alternate') }}{% endif %}"

    def apply_chat_template(self, messages: list[dict], **_: object) -> list[int]:
        if any(a["role"] == b["role"] for a, b in zip(messages, messages[1:])):
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")
        return [7] * len(messages)


def test_a_chat_template_that_refuses_the_messages_is_a_400_naming_them():
    replica = EngineReplica(BulletAppConfig(engine={"model": "mock"}).model_dump(),
                            mock_engine_factory(tokenizer=_AlternatingTemplate()))

    async def go(messages: list[dict]) -> list:
        return [o async for o in replica.generate({"messages": messages, "params": SamplingParams(max_tokens=2)})]

    [refused] = asyncio.run(go([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]))
    assert isinstance(refused, GenerateError) and (refused.status, refused.param) == (400, "messages")
    assert "must alternate" in refused.message
    served = asyncio.run(go([{"role": "user", "content": "a"}]))
    assert served[-1].finished and served[-1].num_output_tokens == 2


class _WordTokenizer:
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [7] * len(text.split())


def test_replica_counts_the_prompt_before_a_per_token_admission_decision():
    """With a per-prompt-token bound the replica tokenizes first: at a predicted TTFT of 2 s and a 1 s floor
    with 100 ms per token, a 5-word prompt (bound 1 s) gets 429 and a 30-word one (bound 3 s) is served."""
    cfg = BulletAppConfig(engine={"model": "mock"}, admission_ttft_s=1.0, admission_ttft_ms_per_prompt_token=100.0)
    replica = EngineReplica(cfg.model_dump(), mock_engine_factory(predicted_ttft_s=2.0, tokenizer=_WordTokenizer()))
    [refused] = _run(replica, " ".join(["w"] * 5), 2)
    assert isinstance(refused, GenerateError) and refused.status == 429 and "bound 1.000 s" in refused.message
    outs = _run(replica, " ".join(["w"] * 30), 2)
    assert not isinstance(outs[0], GenerateError) and outs[-1].finish_reason == "length"
    assert outs[-1].num_prompt_tokens == 30
    assert replica.stats()["num_rejected_total"] == 1


def test_the_prompt_is_counted_only_when_its_length_can_change_the_answer():
    settings = AdmissionSettings(4, admission_ttft_s=1.0, admission_ttft_ms_per_prompt_token=100.0,
                                 admission_tpot_s=0.025)
    assert settings.length_decides(_stats(0, 2.0))  # over the fixed bound: a long prompt may still be admitted
    assert not settings.length_decides(_stats(0, 0.5))  # under it: admitted whatever the length
    assert not settings.length_decides(_stats(4, 2.0))  # the queue refuses anyway
    assert not settings.length_decides(EngineStats(0, 40, 10, 10, predicted_ttft_s=2.0, recent_decode_step_s=0.03))
    assert not settings.length_decides(_stats(0, None))  # no prediction: no TTFT bound applies
    assert not AdmissionSettings(4, admission_ttft_s=1.0).length_decides(_stats(0, 2.0))  # no per-token bound
    per_token_only = AdmissionSettings(4, admission_ttft_ms_per_prompt_token=100.0)
    assert per_token_only.length_decides(_stats(0, 0.3))  # 1-2 tokens refused (bound 0.1-0.2 s), 3 and up admitted
    assert not per_token_only.length_decides(_stats(0, 0.01))  # under even one token's bound: every length admitted


def _sized(ttft_s: float, typical: int, per_token_s: float) -> EngineStats:
    return EngineStats(0, 0, 10, 10, predicted_ttft_s=ttft_s, predicted_ttft_prompt_tokens=typical,
                       ttft_per_prompt_token_s=per_token_s)


def test_the_prediction_follows_the_requests_length():
    """The engine predicts 2 s for its typical 1,000-token prompt, 1 ms per token more or less: a 10-token prompt
    is predicted 1.01 s, a 3,000-token one 4 s; bounds: 1 s floor, 2 ms per token (margin 0)."""
    stats = _sized(2.0, 1000, 0.001)
    assert stats.predicted_ttft_for(10) == pytest.approx(1.01) and stats.predicted_ttft_for(3000) == pytest.approx(4.0)
    assert stats.predicted_ttft_for(None) == 2.0 and _stats(0, 2.0).predicted_ttft_for(10) == 2.0  # typical only
    assert _sized(0.5, 1000, 0.001).predicted_ttft_for(1) == 0.0  # never below zero
    settings = AdmissionSettings(4, admission_ttft_s=1.0, admission_ttft_ms_per_prompt_token=2.0)
    assert "predicted TTFT 1.010 s over the bound 1.000 s" in settings.refusal(stats, 10)
    assert settings.refusal(stats, 3000) is None  # 4 s predicted, 6 s allowed
    assert "predicted TTFT 1.600 s over the bound 1.200 s" in settings.refusal(stats, 600)
    assert settings.length_decides(stats)


def test_length_decides_when_some_lengths_are_refused_and_others_not():
    settings = AdmissionSettings(4, admission_ttft_s=1.0, admission_ttft_ms_per_prompt_token=1.0)
    assert not settings.length_decides(_sized(0.5, 1000, 0.0001))  # far under at every length
    assert not settings.length_decides(_sized(5.0, 100, 0.002))  # over at every length (2 ms > 1 ms per token)
    assert settings.length_decides(_sized(5.0, 100, 0.0005))  # long prompts' bound outgrows the prediction
    assert settings.length_decides(_sized(0.5, 1000, 0.002))  # short admitted, long refused


def test_a_bad_chat_request_is_a_400_whether_or_not_admission_counts_its_prompt():
    cfg = BulletAppConfig(engine={"model": "mock"}, admission_ttft_s=1.0, admission_ttft_ms_per_prompt_token=100.0)
    for predicted in (2.0, 0.5):  # counted before the decision / left to the engine
        replica = EngineReplica(cfg.model_dump(), mock_engine_factory(predicted_ttft_s=predicted,
                                                                      tokenizer=_WordTokenizer()))

        async def go(replica=replica) -> list:
            return [o async for o in replica.generate({"messages": [{"role": "user", "content": "hi"}],
                                                       "params": SamplingParams(max_tokens=2)})]

        [err] = asyncio.run(go())
        assert isinstance(err, GenerateError) and (err.status, err.param) == (400, "messages")
        assert replica.stats()["num_rejected_total"] == 0
