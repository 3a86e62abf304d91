"""The worker-side glue on fakes: step shapes of scheduled batches and the queue the decider leaves."""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import pytest

from bullet_ray.engine.worker.policy_link import SplitDecider, shape_of
from bullet_ray.models.config import ModelConfig
from bullet_ray.perf.kernels import StepShape
from bullet_ray.policy.slo import SloTargets
from bullet_ray.policy.state import QueuedRequest

PRESETS = Path(__file__).resolve().parents[2] / "bullet_ray" / "models" / "presets"


def _item(num_computed: int, num_new: int, rid: str = "r") -> SimpleNamespace:
    return SimpleNamespace(seq=SimpleNamespace(num_computed_tokens=num_computed, request_id=rid), num_new_tokens=num_new)


def test_shapes_of_scheduled_batches():
    assert shape_of([_item(0, 4), _item(0, 2)], "prefill") == StepShape.of_prompts([4, 2])
    assert shape_of([_item(2, 4)], "prefill") == StepShape.of_prompts([6], [2])
    assert shape_of([_item(99, 1), _item(9, 1)], "decode") == StepShape.decode(2, 110)


def test_decider_puts_the_first_batch_first_and_caps_the_step():
    seqs = [SimpleNamespace(request_id=r) for r in ("a", "b", "c", "d")]
    worker = SimpleNamespace(scheduler=SimpleNamespace(waiting=deque(seqs), max_num_batched_tokens=2048),
                             config=SimpleNamespace(max_num_batched_tokens=2048))
    decider = SplitDecider.__new__(SplitDecider)
    decider.worker = worker
    q = {r: QueuedRequest(r, n, 0.0) for r, n in (("a", 900), ("b", 100), ("c", 300), ("d", 50))}
    order = (q["c"], q["d"], q["b"], q["a"])
    decider._apply_order(order, ((q["c"], q["b"]), (q["d"],)))
    assert [s.request_id for s in worker.scheduler.waiting] == ["c", "b", "d", "a"]
    assert worker.scheduler.max_num_batched_tokens == 400


def test_preset_and_hf_folder_share_a_fingerprint():
    from bullet_ray.perf.profile import model_fingerprint

    cfg = ModelConfig.from_hf_dict(json.loads((PRESETS / "tiny-llama.json").read_text()))
    assert model_fingerprint(ModelConfig.from_hf_dict(cfg.to_hf_dict())) == model_fingerprint(cfg)


def test_pushed_targets_and_bounds_reach_the_decider(tmp_path: Path):
    """The controller's push (engine front -> state block) changes what the prefill worker's decision aims at
    and which ladder entries it may choose."""
    from bullet_ray.engine.state_block import StateBlock

    block = StateBlock.create(str(tmp_path / "state"))
    try:
        assert block.slo_targets() is None and block.clamp_to_bounds(7) == 7  # nothing pushed: config's own
        rule = SimpleNamespace(targets=SloTargets(0.5, 0.025))
        decider = SplitDecider.__new__(SplitDecider)
        decider.state, decider.policy = block, SimpleNamespace(targets=rule.targets, rule=rule)
        decider._follow_pushed_targets()
        assert decider.policy.targets == SloTargets(0.5, 0.025)
        block.set_slo_targets(1.0, 0.05)
        block.set_split_bounds(2, 4)
        decider._follow_pushed_targets()
        assert (decider.policy.targets.ttft_s, decider.policy.targets.tpot_s) == (1.0, 0.05)
        assert decider.policy.rule.targets == decider.policy.targets
        assert [block.clamp_to_bounds(i) for i in (0, 3, 9)] == [2, 3, 4]
        # a push replaces the floor and the TPOT target; the config's per-prompt-token TTFT stays
        rule = SimpleNamespace(targets=SloTargets(0.0015, 0.2, ttft_per_token_s=0.0015))
        decider.policy = SimpleNamespace(targets=rule.targets, rule=rule)
        decider._follow_pushed_targets()
        assert decider.policy.targets == SloTargets(1.0, 0.05, ttft_per_token_s=0.0015)
        assert decider.policy.rule.targets == decider.policy.targets
        assert decider.policy.targets.ttft_target_s(500) == 1.0  # the pushed floor
        assert decider.policy.targets.ttft_target_s(2000) == pytest.approx(3.0)  # the per-token part
    finally:
        block.close()


def test_a_step_in_flight_counts_in_the_decision(tmp_path: Path):
    """Planned while its last step runs (asynchronous scheduling), the prefill side's decision sees that
    step's predicted remainder and counts the sequences it completes as decode's (handed off once collected)."""
    import time

    from bullet_ray.engine.state_block import StateBlock

    block = StateBlock.create(str(tmp_path / "state"))
    try:
        waiting = deque([SimpleNamespace(request_id="q", num_tokens=500, arrival_s=time.time(), num_computed_tokens=0)])
        worker = SimpleNamespace(scheduler=SimpleNamespace(waiting=waiting), switch=SimpleNamespace(requested=lambda: 3),
                                 inflight=None, awaiting={}, last_done_s=0.0)
        decider = SplitDecider.__new__(SplitDecider)
        decider.worker, decider.state, decider._last_handoff_s, decider.top_index = worker, block, -1e9, 12
        idle = decider.step_state()
        assert idle.prefill_remaining_s == 0.0 and idle.decode.num_seqs == 0 and len(idle.queue) == 1
        now = time.perf_counter()
        worker.inflight = SimpleNamespace(perf_record=(None, 0.040, True), launched_s=now - 0.010)
        worker.awaiting = {"a": SimpleNamespace(num_tokens=800), "b": SimpleNamespace(num_tokens=200)}
        busy = decider.step_state()
        assert 0.025 < busy.prefill_remaining_s <= 0.030
        assert (busy.decode.num_seqs, busy.decode.num_context_tokens) == (2, 1000)
    finally:
        block.close()


def test_mixed_fallback_starts_on_a_backlog_and_ends_once_it_drains(tmp_path: Path):
    """`mixed_fallback_tokens`: the fallback starts once that many prompt tokens wait while decode runs (not
    while decode idles: prefill then has the GPU to itself), holds while the prompts handed over are in
    transit (until decode has published two steps), and ends under a quarter of it, counting the prompts
    waiting on the decode side."""
    from bullet_ray.engine.state_block import Side, StateBlock
    from bullet_ray.policy.state import DecodeLoad, StepState

    def state(queued: list[int], decode_seqs: int) -> StepState:
        queue = tuple(QueuedRequest(str(i), n, 0.0) for i, n in enumerate(queued))
        return StepState(0, queue, DecodeLoad(decode_seqs, 100 * decode_seqs), 0.0)

    def decode_step(queued_tokens: int) -> None:
        block.annotate(Side.DECODE, predicted_step_us=1, queued_tokens=queued_tokens, is_active=True)
        block.publish(Side.DECODE, num_seqs=4, num_tokens=4, num_context_tokens=400, step_time_us=1,
                      num_queued=1)

    block = StateBlock.create(str(tmp_path / "state"))
    try:
        decider = SplitDecider.__new__(SplitDecider)
        decider.state, decider._last_handoff_s = block, -1e9
        decider.mixed_tokens, decider.is_mixed, decider._handed_over_at_step = 1000, False, -1
        assert not decider.update_mixed(state([600, 300], 4))  # 900 tokens wait: side by side
        assert not decider.update_mixed(state([600, 500], 0))  # nothing decodes
        assert decider.update_mixed(state([600, 500], 4))
        decider.note_prompts_handed_over()
        assert decider.update_mixed(state([], 4))  # in transit: decode has not published since
        decode_step(0)
        assert decider.update_mixed(state([], 4))  # one step: the prompts may not have arrived yet
        decode_step(400)
        assert decider.update_mixed(state([], 4))  # 400 tokens wait on decode: still >= 250
        decode_step(200)
        assert not decider.update_mixed(state([], 4))
        assert not decider.update_mixed(state([700], 4))  # 700 + 200 on decode: starts again only at 1,000
        decider.mixed_tokens = None
        assert not decider.update_mixed(state([5000], 4))
    finally:
        block.close()


def test_handed_over_prompts_in_least_slack_order():
    """The decode side orders the prompts the mixed fallback hands it as the policy orders its queue: a prompt
    already started first, then those that can still meet the TTFT target (least slack first), then the late
    ones (oldest first)."""
    import time

    from bullet_ray.engine.worker.policy_link import order_by_slack

    now = time.time()

    def seq(rid: str, tokens: int, waited_s: float, computed: int = 0) -> SimpleNamespace:
        return SimpleNamespace(request_id=rid, num_tokens=tokens, arrival_s=now - waited_s, num_computed_tokens=computed)

    model = SimpleNamespace(predict_prefill_s=lambda tokens, *args: tokens * 1e-4)  # 1,000 tokens: 0.1 s
    waiting = [seq("late-old", 500, 3.0), seq("roomy", 1000, 0.1), seq("late-new", 500, 1.0),
               seq("tight", 500, 0.4), seq("started", 800, 0.05, computed=400)]
    order = order_by_slack(waiting, model, sms=132, targets=SloTargets(0.5, 0.025))  # type: ignore[arg-type]
    assert [s.request_id for s in order] == ["started", "tight", "roomy", "late-old", "late-new"]
    # prefill_order max_on_time: a 4,000-token prompt (0.4 s) that would make four short ones late goes after them
    crowd = [seq("long", 4000, 0.05), *(seq(f"s{i}", 500, 0.2) for i in range(4))]
    plain = order_by_slack(crowd, model, sms=132, targets=SloTargets(0.5, 0.025))  # type: ignore[arg-type]
    mot = order_by_slack(crowd, model, sms=132, targets=SloTargets(0.5, 0.025),  # type: ignore[arg-type]
                         prefill_order="max_on_time")
    assert [s.request_id for s in plain].index("long") < 4 and mot[-1].request_id == "long"


def test_handed_over_prompts_aim_at_per_prompt_token_targets():
    """With Bullet's per-prompt-token TTFT (1.5 ms a token, floor one token's: the bullet-azure-code preset as
    serve_h100's bullet-slo-bullet-azure-code sets it) a short prompt whose budget is nearly spent goes before a
    long one that arrived first and still has seconds; with the per-token target off every prompt is already
    late against the 1.5 ms floor and they keep their arrival order."""
    import time

    from bullet_ray.engine.worker.policy_link import order_by_slack

    now = time.time()

    def seq(rid: str, tokens: int, waited_s: float) -> SimpleNamespace:
        return SimpleNamespace(request_id=rid, num_tokens=tokens, arrival_s=now - waited_s, num_computed_tokens=0)

    model = SimpleNamespace(predict_prefill_s=lambda tokens, *args: tokens * 1e-4)  # 1,000 tokens: 0.1 s
    # targets with the per-token part: long 6 s (slack 4.6 s), mid 1.5 s (0.9 s), short 0.3 s (0.03 s)
    waiting = [seq("long", 4000, 1.0), seq("mid", 1000, 0.5), seq("short", 200, 0.25)]
    per_token = SloTargets(0.0015, 0.2, ttft_per_token_s=0.0015)
    order = order_by_slack(waiting, model, sms=132, targets=per_token)  # type: ignore[arg-type]
    assert [s.request_id for s in order] == ["short", "mid", "long"]
    fixed = SloTargets(0.0015, 0.2)
    order = order_by_slack(waiting, model, sms=132, targets=fixed)  # type: ignore[arg-type]
    assert [s.request_id for s in order] == ["long", "mid", "short"]


def test_the_decider_aims_at_the_configs_per_prompt_token_target():
    """SplitDecider's policy (and its split rule) get EngineConfig's targets in seconds, the per-token part
    included; without it, none."""
    from bullet_ray.config import EngineConfig

    ladder = [SimpleNamespace(decode_sms=d, prefill_sms=132 - d) for d in (16, 32, 66)]

    def decider(cfg: EngineConfig) -> SplitDecider:
        worker = SimpleNamespace(config=cfg, partitioner=SimpleNamespace(ladder=ladder, whole_index=None),
                                 res=SimpleNamespace(state=None))
        return SplitDecider(worker, SimpleNamespace(), SimpleNamespace())  # type: ignore[arg-type]

    on = decider(EngineConfig(model="dummy:tiny-llama", ttft_target_ms=1.5, tpot_target_ms=200.0,
                              ttft_target_ms_per_prompt_token=1.5))
    assert on.policy.targets == SloTargets(0.0015, 0.2, ttft_per_token_s=0.0015)
    assert on.policy.rule.targets == on.policy.targets and on.policy.targets.ttft_target_s(2000) == pytest.approx(3.0)
    off = decider(EngineConfig(model="dummy:tiny-llama"))
    assert off.policy.targets == SloTargets(0.5, 0.025) and off.policy.targets.ttft_target_s(2000) == 0.5


def test_prefill_order_reaches_the_policy_from_the_yaml_edge_and_a_bad_one_names_the_field():
    """engine.prefill_order: least_slack (default) or max_on_time; the policy link builds BulletPolicy with it."""
    import pytest
    import yaml
    from pydantic import ValidationError

    from bullet_ray.config import EngineConfig
    from bullet_ray.errors import ConfigError
    from bullet_ray.serve.config import BulletAppConfig, EngineArgs

    args = BulletAppConfig(**yaml.safe_load(yaml.safe_dump({"engine": {"prefill_order": "max_on_time"}}))).engine
    assert args.to_engine_config().prefill_order == "max_on_time"
    assert EngineArgs().to_engine_config().prefill_order == "least_slack"
    with pytest.raises(ConfigError, match=r"^prefill_order: unknown prefill order 'edf'; choose least_slack"):
        EngineConfig(prefill_order="edf")
    with pytest.raises(ValidationError, match="prefill_order"):
        EngineArgs(prefill_order="edf")
    with pytest.raises(ConfigError, match=r"^prefill_order: fallback_first orders the queue by the fallback TTFT target"):
        EngineConfig(prefill_order="fallback_first")  # without ttft_fallback_ms
    from bullet_ray.gpu.partition import default_ladder
    from bullet_ray.perf.model import PerfModel
    from bullet_ray.perf.roofline import H100_SXM

    llama = ModelConfig.from_hf_dict(json.loads((PRESETS / "llama-3.1-8b.json").read_text()))
    for order in ("least_slack", "max_on_time", "fallback_first"):
        worker = SimpleNamespace(config=EngineConfig(prefill_order=order, split_policy="slo", ttft_fallback_ms=1000.0),
                                 partitioner=SimpleNamespace(ladder=[SimpleNamespace(decode_sms=d, prefill_sms=132 - d)
                                                                     for d in default_ladder(132)], whole_index=None),
                                 res=SimpleNamespace(state=None))
        decider = SplitDecider(worker, PerfModel(llama, H100_SXM), recorder=None)
        assert decider.policy.prefill_order == order
    # engine.prefill_saturation_share reaches the policy the same way
    worker.config = EngineConfig(split_policy="slo", prefill_saturation_share=0.98)
    assert SplitDecider(worker, PerfModel(llama, H100_SXM), recorder=None).policy.saturation_share == 0.98
