"""benchmarks.replay_split on a tiny synthetic run and step log (CPU, no noise: deterministic)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from benchmarks import replay_split as rs
from benchmarks.plot_steps import records
from benchmarks.replay_split import noise
from bullet_ray.perf.kernels import StepShape

PREFILL = (0.005, 30e-6, 1e-9)  # fixed s, per token, per attention pair
DECODE = (0.02, 2e-4, 1e-8)  # fixed s, per sequence, per context token


def _step(phase: str, shape: StepShape, sms: int, busy: bool, seconds: float) -> dict:
    return {"kind": "step", "side": phase, "phase": phase, "num_tokens": shape.num_tokens, "num_seqs": shape.num_seqs,
            "num_context_tokens": shape.num_context_tokens, "num_attention_pairs": shape.num_attention_pairs,
            "decode_sms": 132 - sms if phase == "prefill" else sms,
            "prefill_sms": sms if phase == "prefill" else 132 - sms, "other_busy": busy,
            "predicted_ms": seconds * 1e3 * 1.05, "measured_ms": seconds * 1e3, "across_switch": False}


def write_log(path: Path) -> None:
    rows = []
    for busy in (False, True):
        for k in range(1, 31):
            p = StepShape.of_prompts([100 * k, 37 * k + 5])
            rows.append(_step("prefill", p, 116, busy, PREFILL[0] + PREFILL[1] * p.num_tokens
                              + PREFILL[2] * p.num_attention_pairs))
            d = StepShape.decode(k, 300 * k + 11 * k * k)
            rows.append(_step("decode", d, 16, busy, DECODE[0] + DECODE[1] * d.num_seqs
                              + DECODE[2] * d.num_context_tokens))
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def write_run(path: Path, num: int = 12) -> None:
    reqs = [{"index": i, "scheduled_s": 0.03 * i, "prompt_tokens": 200 + 150 * (i % 5),
             "prompt_tokens_requested": 200 + 150 * (i % 5), "output_tokens_requested": 1 + 7 * (i % 4),
             "success": True, "ttft_s": 0.1, "tpot_s": 0.02 if i % 4 else None, "itl_s": [0.02] * (7 * (i % 4))}
            for i in range(num)]
    path.write_text(json.dumps({"requests": reqs}))


@pytest.fixture(scope="module")
def factory():
    return rs.profile_model_factory()


@pytest.fixture()
def setup(tmp_path: Path, factory):
    write_log(tmp_path / "sys-steps.jsonl")
    write_run(tmp_path / "run.json")
    reqs, measured = rs.load_requests(tmp_path / "run.json")
    steps = rs.fit_step_model(records(str(tmp_path / "sys-steps.jsonl")), factory())
    steps.sigma = {"prefill": 0.0, "decode": 0.0}
    return reqs, measured, steps


def test_fits_recover_the_synthetic_coefficients(setup) -> None:
    _, _, steps = setup
    assert steps.fits[("prefill", 116, True)].coef == pytest.approx(PREFILL, rel=1e-3, abs=1e-12)
    assert steps.fits[("decode", 16, False)].coef == pytest.approx(DECODE, rel=1e-3, abs=1e-12)
    # an entry not in the log: the nearest fit scaled by the roofline, slower on fewer SMs
    shape = StepShape.of_prompts([1000])
    assert steps.seconds(shape, 100, True) > steps.seconds(shape, 116, True)


def test_replay_is_deterministic_and_conserves_tokens(setup, factory) -> None:
    reqs, _, steps = setup
    a = rs.replay(reqs, steps, rs.make_policy(factory, 0.0, "all", 2048))
    b = rs.replay(reqs, steps, rs.make_policy(factory, 0.0, "all", 2048))
    assert a.ttft_s == b.ttft_s and a.tpot_s == b.tpot_s
    for r, ttft, tpot, tokens in zip(reqs, a.ttft_s, a.tpot_s, a.num_tokens):
        assert ttft is not None and ttft > 0
        assert tokens == r.num_output_tokens
        assert (tpot is None) == (r.num_output_tokens == 1)
    assert 0 < a.max_decode_seqs <= len(reqs)


def test_a_requested_split_applies_at_each_sides_next_launch(setup, factory) -> None:
    reqs, _, steps = setup
    out = rs.replay(reqs, steps, rs.make_policy(factory, 0.0, "all", 2048))
    requested, num_requests = 0, 0
    for kind, _, index in out.timeline:
        if kind == "request":
            requested, num_requests = index, num_requests + 1
        else:
            assert index == requested, (kind, index, requested)
    assert num_requests >= 1  # the split moved at least once (ONLY_PREFILL / ONLY_DECODE)


@pytest.mark.parametrize(("scope", "split_margin_s"), [("all", 0.05), ("order", 0.0)])
def test_margin_and_scope_reach_the_policy(factory, scope: str, split_margin_s: float) -> None:
    policy = rs.make_policy(factory, 50.0, scope, 4096)
    assert policy.targets.margin_s == pytest.approx(0.05)
    assert policy.rule.targets.margin_s == pytest.approx(split_margin_s)
    assert policy.token_cap == 4096


def test_scores_count_miss_kinds(setup) -> None:
    reqs, _, _ = setup
    n = len(reqs)
    sc = rs.score(reqs, [0.6] + [0.1] * (n - 1), [0.03, 0.03] + [None] * (n - 2))
    assert (sc["both"], sc["tpot"], sc["ttft"]) == (1, 1, 0)
    assert sc["attainment"] == pytest.approx((n - 2) / n)
    # relaxed (1,000 / 50 ms): the 0.6 s TTFT and the 30 ms TPOTs all pass
    relaxed = rs.score(reqs, [0.6] + [0.1] * (n - 1), [0.03, 0.03] + [None] * (n - 2), "relaxed")
    assert (relaxed["both"], relaxed["tpot"], relaxed["ttft"], relaxed["attainment"]) == (0, 0, 0, 1.0)


def test_slo_targets_reach_the_policy(factory) -> None:
    """--slo relaxed: the policy plans for 1,000 ms TTFT and splits for 50 ms TPOT, as bullet-slo-relaxed ran."""
    relaxed = rs.make_policy(factory, 0.0, "all", 4096, slo_name="relaxed")
    assert (relaxed.targets.ttft_s, relaxed.rule.targets.tpot_s) == (pytest.approx(1.0), pytest.approx(0.05))
    strict = rs.make_policy(factory, 0.0, "all", 4096)
    assert (strict.targets.ttft_s, strict.rule.targets.tpot_s) == (pytest.approx(0.5), pytest.approx(0.025))


def test_decode_pause_holds_decode_while_prefill_runs_alone(setup, factory) -> None:
    """The DecodePause what-if: prefill steps run with decode held (no decode launch inside a pause), every request
    still gets all its tokens, and a TPOT aim no sequence can meet takes no pause at all."""
    from benchmarks.replay_split.sim import DecodePause
    from bullet_ray.policy.state import SplitReason

    reqs, _, steps = setup
    every = tuple(r.value for r in SplitReason)
    out = rs.replay(reqs, steps, rs.make_policy(factory, 0.0, "all", 2048),
                    pause=DecodePause(speedup=1.1, tpot_aim=100.0, reasons=every))
    assert out.pauses and out.num_tokens == [r.num_output_tokens for r in reqs]
    decode_launches = [t for kind, t, _ in out.timeline if kind == "decode"]
    assert not any(start < t < end for start, end in out.pauses for t in decode_launches)
    assert [t for kind, t, _ in out.timeline if kind == "pause"] == [start for start, _ in out.pauses]
    none = rs.replay(reqs, steps, rs.make_policy(factory, 0.0, "all", 2048),
                     pause=DecodePause(speedup=1.1, tpot_aim=1e-6, reasons=every))
    assert not none.pauses


def test_an_at_risk_pause_follows_only_decisions_that_predict_a_ttft_miss(setup, factory) -> None:
    """The pseudo-reason at_risk: a pause may follow any decision predicting a queued request past its target (a
    burst makes some), and a pause no sequence's TPOT affords still runs none."""
    from benchmarks.replay_split.sim import AT_RISK, DecodePause

    _, _, steps = setup
    # a burst: 30 prompts of 3,000 tokens 1 ms apart, more than prefill serves within the 500 ms target
    reqs = [rs.Request(str(i), 0.001 * i, 3000, 9) for i in range(30)]
    tight = rs.replay(reqs, steps, rs.make_policy(factory, 0.0, "all", 2048),
                      pause=DecodePause(speedup=1.1, tpot_aim=100.0, reasons=(AT_RISK,)))
    assert tight.pauses and tight.num_tokens == [r.num_output_tokens for r in reqs]
    assert not rs.replay(reqs, steps, rs.make_policy(factory, 0.0, "all", 2048),
                         pause=DecodePause(speedup=1.1, tpot_aim=1e-6, reasons=(AT_RISK,))).pauses


def test_split_rule_settings_reach_the_policy(factory) -> None:
    policy = rs.make_policy(factory, 50.0, "all", 4096, split_rule={"aim": 0.9, "backlog_aim": 1.0})
    assert (policy.rule.settings.aim, policy.rule.settings.backlog_aim) == (0.9, 1.0)
    assert rs.make_policy(factory, 50.0, "all", 4096).rule.settings.aim == 0.85  # SplitSettings' default
    assert rs.make_policy(factory, 50.0, "all", 4096, prefill_order="max_on_time").prefill_order == "max_on_time"
    assert rs.make_policy(factory, 50.0, "all", 4096).prefill_order == "least_slack"
    assert rs.make_policy(factory, 50.0, "all", 4096, fallback_ms=1000).targets.fallback_ttft_s == pytest.approx(1.0)
    assert rs.make_policy(factory, 50.0, "all", 8192, backlog_batch_tokens=8192).backlog_batch_tokens == 8192
    assert rs.make_policy(factory, 50.0, "all", 4096).backlog_batch_tokens is None
    assert rs.make_policy(factory, 50.0, "all", 4096, saturation_share=0.99).saturation_share == 0.99
    assert rs.make_policy(factory, 50.0, "all", 4096).saturation_share == 0.95


@pytest.mark.parametrize(("flag", "value", "bad"), [("--scopes", "all,bogus", "bogus"), ("--noise", "gaussian", "gaussian"),
                                                    ("--split-rule", '{"aimm": 0.9}', "aimm"),
                                                    ("--split-rule", '{"aim": 1.5}', "aim"),
                                                    ("--split-rule", "[0.9]", "[0.9]"),
                                                    ("--decode-pause", "0", "0"),
                                                    ("--prefill-order", "edf", "edf"),
                                                    ("--prefill-order", "fallback_first", "ttft_fallback_ms"),
                                                    ("--slo", "lax", "lax"),
                                                    ("--score-slo", "lax", "lax"),
                                                    ("--margins", "0,500", "500"),
                                                    ("--fallback-ms", "400", "400"),
                                                    ("--backlog-batch-tokens", "0", "0"),
                                                    ("--saturation-share", "1.5", "1.5"),
                                                    ("--ladder", "16,8", "ascending"),
                                                    ("--ladder", "8,132", "132"),
                                                    ("--ladder", "8,x", "x"),
                                                    ("--slo", "bullet-sharegpt", "per prompt token"),
                                                    ("--decode-pause-aim", "0.8", "--decode-pause"),
                                                    ("--decode-pause-reasons", "backlog", "--decode-pause")])
def test_cli_rejects_a_bad_value_naming_the_flag(tmp_path: Path, capsys, flag: str, value: str, bad: str) -> None:
    with pytest.raises(SystemExit) as e:
        rs.main([flag, value, "--run", str(tmp_path / "none.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err and bad in err


def test_cli_rejects_an_unknown_pause_reason(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        rs.main(["--decode-pause", "1.1", "--decode-pause-reasons", "backlog,rush", "--run", str(tmp_path / "x.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--decode-pause-reasons" in err and "'backlog,rush'" in err


def test_cli_runs_end_to_end(tmp_path: Path) -> None:
    write_log(tmp_path / "sys-steps.jsonl")
    write_run(tmp_path / "run.json")
    out = tmp_path / "out.json"
    assert rs.main(["--run", str(tmp_path / "run.json"), "--steps", str(tmp_path / "sys-steps.jsonl"),
                    "--margins", "0,50", "--scopes", "order", "--seeds", "2", "--no-progress", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["token_cap"] == 2048 and [r["margin_ms"] for r in doc["rows"]] == [0.0, 50.0]
    assert "not measured" in doc["note"] and doc["prefill_order"] == "least_slack"
    assert rs.main(["--run", str(tmp_path / "run.json"), "--steps", str(tmp_path / "sys-steps.jsonl"), "--margins",
                    "50", "--seeds", "1", "--no-progress", "--prefill-order", "max_on_time", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["prefill_order"] == "max_on_time"
    assert rs.main(["--run", str(tmp_path / "run.json"), "--steps", str(tmp_path / "sys-steps.jsonl"), "--margins",
                    "0", "--seeds", "1", "--no-progress", "--slo", "relaxed", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["slo"] == "relaxed"
    assert rs.main(["--run", str(tmp_path / "run.json"), "--steps", str(tmp_path / "sys-steps.jsonl"), "--margins",
                    "50", "--seeds", "1", "--no-progress", "--score-slo", "relaxed", "--json", str(out)]) == 0
    assert (json.loads(out.read_text())["slo"], json.loads(out.read_text())["aim_slo"]) == ("relaxed", "strict")
    assert rs.main(["--run", str(tmp_path / "run.json"), "--steps", str(tmp_path / "sys-steps.jsonl"), "--margins",
                    "50", "--seeds", "1", "--no-progress", "--fallback-ms", "1000", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["ttft_fallback_ms"] == 1000
    assert json.loads(out.read_text())["prefill_backlog_batch_tokens"] is None
    assert rs.main(["--run", str(tmp_path / "run.json"), "--steps", str(tmp_path / "sys-steps.jsonl"), "--margins",
                    "50", "--seeds", "1", "--no-progress", "--backlog-batch-tokens", "2048", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["prefill_backlog_batch_tokens"] == 2048
    assert json.loads(out.read_text())["prefill_saturation_share"] == 0.95
    assert json.loads(out.read_text())["ladder"] == list(range(16, 113, 8))  # no YAML beside the log: the default
    assert rs.main(["--run", str(tmp_path / "run.json"), "--steps", str(tmp_path / "sys-steps.jsonl"), "--margins",
                    "0", "--seeds", "1", "--no-progress", "--ladder", "8,16,64", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["ladder"] == [8, 16, 64]
    # a -fl<SMs> system's YAML beside its step log names the ladder the run used
    (tmp_path / "sys.yaml").write_text("applications:\n- args:\n    engine:\n      decode_sm_counts: [8, 16, 24]\n")
    assert rs.ladder_of(tmp_path / "sys-steps.jsonl") == [8, 16, 24]
    # a step log named otherwise (a call's copy: sys-steps_call15.jsonl) has no YAML beside it: the default ladder
    assert rs.ladder_of(tmp_path / "sys-steps_call15.jsonl") == list(range(16, 113, 8))
    assert rs.main(["--run", str(tmp_path / "run.json"), "--steps", str(tmp_path / "sys-steps.jsonl"), "--margins",
                    "0", "--seeds", "1", "--no-progress", "--decode-pause", "1.1", "--decode-pause-reasons",
                    "backlog,at_risk", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["decode_pause"]["reasons"] == ["backlog", "at_risk"]
    random.Random(0)  # the CLI's replays seed their own generators


def test_warm_up_learns_only_the_steps_before_the_run(factory) -> None:
    shape = StepShape.decode(8, 4000)
    model = factory()
    cold = model.predict(shape, 16, True, 0).seconds
    rec = {**_step("decode", shape, 16, True, cold * 1.3), "split_index": 0}
    rows = [{**rec, "t": 1.0}, {**rec, "t": 2.0, "across_switch": True}, {**rec, "t": 5.0}, {"kind": "decision", "t": 0.5}]
    before = rs.steps_before(rows, 3.0)
    assert [r["t"] for r in before] == [1.0]
    rs.warm_up(model, before * 3)  # the correction needs 3 samples
    assert model.predict(shape, 16, True, 0).seconds == pytest.approx(cold * 1.3, rel=1e-3)
    # with the replayed ladder the step counts for the entry of its decode SMs: index 1 of a ladder from 8 SMs
    fresh = factory()
    rs.warm_up(fresh, before * 3, [8, 16, 24])
    assert fresh.online.describe()["decode.1.size3"] == pytest.approx(1.3, rel=1e-3)
    assert not any(k.startswith("decode.0.") for k in fresh.online.describe())


def test_residuals_of_one_replay_the_fitted_times(setup, factory) -> None:
    reqs, _, steps = setup
    clean = rs.replay(reqs, steps, rs.make_policy(factory, 0.0, "all", 2048))
    steps.residuals = noise.ResidualNoise({"prefill": [1.0] * 5, "decode": [1.0] * 5}, {"decode": 4.0})
    ones = rs.replay(reqs, steps, rs.make_policy(factory, 0.0, "all", 2048), random.Random(3))
    assert ones.ttft_s == clean.ttft_s and ones.tpot_s == clean.tpot_s


@pytest.mark.parametrize("block", [1.0, 5.0])
def test_resampled_ratios_come_from_the_set(block: float) -> None:
    entry = [0.9, 1.1, 1.3]
    res = noise.ResidualNoise({("decode", 16, False): entry, "decode": [7.0], "prefill": [2.0]}, {"decode": block})
    rng = random.Random(0)
    assert {res.ratio("decode", 16, False, rng) for _ in range(200)} == set(entry)
    assert {res.ratio("decode", 24, False, rng) for _ in range(5)} == {7.0}  # no own set: the side's
    assert res.ratio("prefill", 116, True, rng) == 2.0


def test_blocks_persist_and_autocorrelation_is_measured() -> None:
    entry = [float(v) for v in range(1, 101)]
    res = noise.ResidualNoise({"decode": entry}, {"decode": 1e9})  # never jumps after the first draw
    rng = random.Random(1)
    draws = [res.ratio("decode", 16, False, rng) for _ in range(10)]
    assert all(b == a % 100 + 1 for a, b in zip(draws, draws[1:]))
    assert noise.lag_autocorrelation(entry) > 0.9
    assert noise.block_steps_of({"decode": entry, "prefill": [1.0, 2.0] * 20})["prefill"] == 1.0


def test_a_fixed_arrival_delay_shifts_first_tokens_by_that_much(setup, factory) -> None:
    _, _, steps = setup
    reqs = [rs.Request("a", 0.0, 300, 3), rs.Request("b", 2.0, 500, 2)]  # far apart: nothing else moves
    base = rs.replay(reqs, steps, rs.make_policy(factory, 0.0, "all", 2048), relay_s=0.002)
    late = rs.replay(reqs, steps, rs.make_policy(factory, 0.0, "all", 2048),
                     delays=noise.Delays((0.037,), (0.002,)))
    for b, t in zip(base.ttft_s, late.ttft_s):
        assert t == pytest.approx(b + 0.037, abs=1e-9)
    assert late.tpot_s == pytest.approx(base.tpot_s)


def test_transit_counts_only_what_the_replay_does_not_wait_for() -> None:
    ends, starts = [1.0, 2.0, 3.0], [0.5, 1.5, 2.5]
    assert noise.transit_lower_bound(1.2, 2.01, ends, starts) == 0.0  # read after the next step end: modelled
    assert noise.transit_lower_bound(0.9, 3.01, ends, starts) == pytest.approx(1.1)  # missed the read at 2.0
    assert noise.transit_lower_bound(5.0, 5.003, ends, starts) == pytest.approx(0.003)  # idle: all of it



def test_cli_runs_with_empirical_noise(tmp_path: Path) -> None:
    write_log(tmp_path / "sys-steps.jsonl")
    write_run(tmp_path / "run.json")
    out = tmp_path / "out.json"
    assert rs.main(["--run", str(tmp_path / "run.json"), "--steps", str(tmp_path / "sys-steps.jsonl"), "--margins",
                    "0", "--scopes", "all", "--seeds", "2", "--no-progress", "--noise", "empirical", "--json",
                    str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["noise"] == "empirical" and doc["delays"] == "none" and set(doc["block_steps"]) == {"prefill", "decode"}


def test_prefill_speedup_scales_prefill_steps_only_and_reaches_the_json(setup, tmp_path: Path, capsys) -> None:
    _, _, steps = setup
    prompt, decode = StepShape.of_prompts([1000]), StepShape.decode(8, 4000)
    before = steps.seconds(prompt, 116, True), steps.seconds(decode, 16, True)
    steps.prefill_speedup = 2.0
    assert steps.seconds(prompt, 116, True) == pytest.approx(before[0] / 2)
    assert steps.seconds(decode, 16, True) == pytest.approx(before[1])
    write_log(tmp_path / "sys-steps.jsonl")
    write_run(tmp_path / "run.json")
    out = tmp_path / "out.json"
    assert rs.main(["--run", str(tmp_path / "run.json"), "--steps", str(tmp_path / "sys-steps.jsonl"), "--margins",
                    "0", "--scopes", "all", "--seeds", "1", "--no-progress", "--prefill-speedup", "1.25",
                    "--json", str(out)]) == 0
    assert json.loads(out.read_text())["prefill_speedup"] == 1.25
    assert "prefill steps 1.25x faster than logged" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        rs.main(["--run", str(tmp_path / "run.json"), "--prefill-speedup", "0"])
    assert "--prefill-speedup" in capsys.readouterr().err
