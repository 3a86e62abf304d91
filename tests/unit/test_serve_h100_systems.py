"""The GPU comparison runner's systems are YAML copies of deploy/gpu.yaml with the right engine settings."""

from __future__ import annotations

import json

import pytest
import yaml

from benchmarks.gpu import serve_h100
from benchmarks.gpu.serve_h100 import GPU_YAML, parse_system, system_yaml
from bullet_ray.config import EngineConfig
from tests.metrics_pages import serve_pages


def _engine(path):
    return yaml.safe_load(path.read_text())["applications"][0]["args"]["engine"]


def test_bullet_is_the_deploy_yaml_with_cublas_pinned(tmp_path):
    """"bullet" is deploy/gpu.yaml as shipped but for prefill_gemm: cublas (a system's name keeps what it measured
    before the engine's auto default tuned cuBLASLt)."""
    engine, shipped = _engine(system_yaml("bullet", tmp_path)), _engine(GPU_YAML)
    assert engine.pop("prefill_gemm") == "cublas" and "prefill_gemm" not in shipped
    assert engine.pop("prefill_plan_lead_ms") is None and "prefill_plan_lead_ms" not in shipped
    # the shipped split policy (slo, strict targets, margin 50, max_on_time, the 1 s fallback target) is not
    # "bullet"'s: that is the fixed split
    assert (shipped.pop("split_policy"), shipped.pop("ttft_margin_ms"), shipped.pop("prefill_order")) == ("slo", 50, "max_on_time")
    assert shipped.pop("ttft_fallback_ms") == 1000
    assert (shipped.pop("ttft_target_ms"), shipped.pop("tpot_target_ms")) == (500, 25) and engine == shipped


def test_the_shipped_deployment_is_a_named_system(tmp_path):
    """bullet-slo-margin50-pl10-mot-fb1000+lt is deploy/gpu.yaml as shipped, bar the step log serve_h100 adds: the
    name the README's figures quote measures the YAML users run."""
    engine, shipped = _engine(system_yaml("bullet-slo-margin50-pl10-mot-fb1000+lt+direct", tmp_path)), _engine(GPU_YAML)
    assert engine.pop("step_log_path").endswith("bullet-slo-margin50-pl10-mot-fb1000+lt+direct-steps.jsonl")
    # the engine's defaults, which the shipped YAML leaves to them: auto tunes cuBLASLt on a GPU bullet worker
    assert (engine.pop("prefill_gemm"), engine.pop("prefill_plan_lead_ms")) == ("cublaslt", 10)
    # the system takes the strict targets from EngineConfig's defaults, the YAML states them
    defaults = EngineConfig()
    assert (shipped.pop("ttft_target_ms"), shipped.pop("tpot_target_ms")) == (defaults.ttft_target_ms, defaults.tpot_target_ms)
    assert engine == shipped


def test_slo_layerwise_and_chunked_systems(tmp_path):
    slo = _engine(system_yaml("bullet-slo", tmp_path))
    assert slo["split_policy"] == "slo" and "prefill_layer_groups" not in slo
    assert slo["step_log_path"].endswith("bullet-slo-steps.jsonl")
    lw = _engine(system_yaml("bullet-slo-lw4+sync", tmp_path))
    assert (lw["split_policy"], lw["prefill_layer_groups"], lw["prefill_layer_group_min_tokens"]) == ("slo", 4, 256)
    assert lw["async_scheduling"] is False and lw["step_log_path"].endswith("bullet-slo-lw4+sync-steps.jsonl")
    late = _engine(system_yaml("bullet-slo-late20+direct", tmp_path))
    assert (late["split_policy"], late["prefill_plan_lead_ms"]) == ("slo", 20) and slo["prefill_plan_lead_ms"] is None
    assert late["step_log_path"].endswith("bullet-slo-late20+direct-steps.jsonl")
    margin = _engine(system_yaml("bullet-slo-margin50+direct", tmp_path))
    assert (margin["split_policy"], margin["ttft_margin_ms"]) == ("slo", 50) and "ttft_margin_ms" not in slo
    assert "ttft_target_ms" not in margin and margin["step_log_path"].endswith("bullet-slo-margin50+direct-steps.jsonl")
    assert "ttft_margin_scope" not in margin  # the engine's default, all: the YAML of the measured runs
    omargin = _engine(system_yaml("bullet-slo-omargin25", tmp_path))
    assert (omargin["split_policy"], omargin["ttft_margin_ms"], omargin["ttft_margin_scope"]) == ("slo", 25, "order")
    assert "ttft_margin_scope" not in slo and omargin["step_log_path"].endswith("bullet-slo-omargin25-steps.jsonl")
    mixed = _engine(system_yaml("bullet-slo-mixed8192", tmp_path))
    assert (mixed["split_policy"], mixed["mixed_fallback_tokens"]) == ("slo", 8192) and "mixed_fallback_tokens" not in slo
    m2 = _engine(system_yaml("bullet-slo-m2", tmp_path))
    assert m2["split_rule"] == {"backlog_aim": None, "idle_decode": "fastest"} and m2["split_policy"] == "slo"
    overlap = _engine(system_yaml("bullet-slo-overlap+direct", tmp_path))
    assert (overlap["split_policy"], overlap["split_switch"]) == ("slo", "overlap") and "split_switch" not in slo
    disjoint = _engine(system_yaml("bullet-slo-disjoint+direct", tmp_path))
    assert (disjoint["split_policy"], disjoint["split_switch"]) == ("slo", "disjoint")
    handoff = _engine(system_yaml("bullet-slo+handoff", tmp_path))
    assert (handoff["split_policy"], handoff["handoff"]) == ("slo", "direct") and "handoff" not in slo
    assert handoff["step_log_path"].endswith("bullet-slo+handoff-steps.jsonl")
    assert parse_system("bullet-slo+handoff+direct") == ("bullet-slo", "handoff", True)
    relaxed = _engine(system_yaml("bullet-slo-relaxed", tmp_path))
    assert (relaxed["split_policy"], relaxed["ttft_target_ms"], relaxed["tpot_target_ms"]) == ("slo", 1000.0, 50.0)
    assert "ttft_target_ms" not in slo and relaxed["step_log_path"].endswith("bullet-slo-relaxed-steps.jsonl")
    assert "ttft_target_ms_per_prompt_token" not in relaxed
    chunked = _engine(system_yaml("chunked-2048", tmp_path))
    assert (chunked["schedule"], chunked["max_num_batched_tokens"]) == ("chunked", 2048)
    assert "piecewise_graph_tokens" not in chunked
    assert _engine(system_yaml("chunked-2048+fixedpw", tmp_path))["piecewise_buckets"] == "fixed"
    overlap_engine = _engine(system_yaml("chunked-2048+attnoverlap", tmp_path))  # an environment variable, not YAML
    assert {k: v for k, v in overlap_engine.items() if k != "step_log_path"} \
        == {k: v for k, v in chunked.items() if k != "step_log_path"}
    assert "piecewise_buckets" not in chunked
    eager = _engine(system_yaml("chunked-2048+nopw", tmp_path))
    assert eager["piecewise_graph_tokens"] == 0 and "async_scheduling" not in eager
    old = _engine(system_yaml("chunked-2048+pw1024", tmp_path))
    assert old["piecewise_graph_tokens"] == 1024 and old["step_log_path"].endswith("chunked-2048+pw1024-steps.jsonl")


def test_margin_system_plans_shorter_and_scores_the_strict_targets(tmp_path):
    """bullet-slo-margin<ms>: a valid engine config whose policy plans for 500 - <ms> ms while its SLO metrics
    keep 500 ms."""
    from bullet_ray.serve.config import EngineArgs

    cfg = EngineArgs(**_engine(system_yaml("bullet-slo-margin50", tmp_path))).to_engine_config()
    assert cfg.planning_targets().ttft_target_s(100) == pytest.approx(0.45)
    assert cfg.slo_targets().ttft_target_s(100) == 0.5
    assert cfg.split_targets() == cfg.planning_targets()  # the split rule plans with the margin too


def test_order_margin_system_keeps_the_real_targets_for_the_split_rule(tmp_path):
    """bullet-slo-omargin<ms>: the order and the batches' fit plan for 500 - <ms> ms, the split rule for 500 ms."""
    from bullet_ray.serve.config import EngineArgs

    cfg = EngineArgs(**_engine(system_yaml("bullet-slo-omargin50", tmp_path))).to_engine_config()
    assert cfg.ttft_margin_scope == "order" and cfg.planning_targets().ttft_target_s(100) == pytest.approx(0.45)
    assert cfg.split_targets() == cfg.slo_targets() and cfg.split_targets().ttft_target_s(100) == 0.5


def test_per_prompt_token_presets_reach_the_engine_config(tmp_path):
    """bullet-slo-<preset> for Bullet's per-prompt-token presets: the per-token target, a floor of one token's
    worth (a request's target is then 1.5 ms x its prompt tokens, as the bench scores it), the preset's TPOT; and
    the YAML's engine args are a valid engine config."""
    from bullet_ray.serve.config import EngineArgs

    azure = _engine(system_yaml("bullet-slo-bullet-azure-code", tmp_path))
    assert (azure["split_policy"], azure["ttft_target_ms"], azure["ttft_target_ms_per_prompt_token"],
            azure["tpot_target_ms"]) == ("slo", 1.5, 1.5, 200.0)
    assert azure["step_log_path"].endswith("bullet-slo-bullet-azure-code-steps.jsonl")
    targets = EngineArgs(**azure).to_engine_config().slo_targets()
    assert targets.ttft_target_s(1) == pytest.approx(0.0015) and targets.ttft_target_s(4000) == pytest.approx(6.0)
    sharegpt = _engine(system_yaml("bullet-slo-bullet-sharegpt+direct", tmp_path))
    assert (sharegpt["ttft_target_ms"], sharegpt["ttft_target_ms_per_prompt_token"], sharegpt["tpot_target_ms"]) \
        == (3.0, 3.0, 150.0)
    # the other families are not taken for presets
    late = _engine(system_yaml("bullet-slo-late100", tmp_path))
    assert late["prefill_plan_lead_ms"] == 100 and "ttft_target_ms" not in late


@pytest.mark.parametrize("name", ["bullet-slo-lw1", "bullet-slo-lwx", "bullet-slo-latex", "bullet-slo-marginx",
                                  "bullet-slo-omarginx", "fancy", "bullet+fast",
                                  "chunked-2048+pwx", "bullet-slo-foo", "bullet-slo-strict", "bullet-slo-bullet"])
def test_unknown_systems_exit_with_a_message(tmp_path, name):
    with pytest.raises(SystemExit, match="unknown"):
        system_yaml(name, tmp_path)


@pytest.mark.parametrize(("system", "parsed"), [
    ("chunked-2048", ("chunked-2048", "", False)),
    ("chunked-2048+direct", ("chunked-2048", "", True)),
    ("bullet-slo+direct", ("bullet-slo", "", True)),
    ("chunked-2048+pw1024+direct", ("chunked-2048", "pw1024", True)),
    ("chunked-2048+direct+sync", ("chunked-2048", "sync", True)),
    ("bullet-slo-lw4+sync", ("bullet-slo-lw4", "sync", False)),
])
def test_parse_system_splits_off_direct(system, parsed):
    assert parse_system(system) == parsed


@pytest.mark.parametrize("system", ["chunked-2048+direct+direct", "chunked-2048+sync+nopw", "bullet+directx"])
def test_parse_system_rejects_repeated_or_unknown_suffixes(system):
    with pytest.raises(SystemExit, match="unknown"):
        parse_system(system)


def test_direct_leaves_the_yaml_as_it_is_but_names_its_files_apart(tmp_path):
    assert _engine(system_yaml("bullet+direct", tmp_path)) == _engine(system_yaml("bullet", tmp_path))
    plain, direct = _engine(system_yaml("chunked-2048", tmp_path)), _engine(system_yaml("chunked-2048+direct", tmp_path))
    assert (tmp_path / "chunked-2048+direct.yaml").exists()
    assert direct.pop("step_log_path").endswith("chunked-2048+direct-steps.jsonl")
    assert plain.pop("step_log_path").endswith("chunked-2048-steps.jsonl") and direct == plain
    both = _engine(system_yaml("chunked-2048+pw1024+direct", tmp_path))
    assert both["piecewise_graph_tokens"] == 1024 and both["step_log_path"].endswith("chunked-2048+pw1024+direct-steps.jsonl")
    slo = _engine(system_yaml("bullet-slo+direct", tmp_path))
    assert slo["split_policy"] == "slo" and slo["step_log_path"].endswith("bullet-slo+direct-steps.jsonl")


def test_merge_rebuilds_a_sweep_cut_short_from_its_run_files(tmp_path):
    """A sweep killed after its last rate but before it wrote compare.json: --merge takes its folder and
    rebuilds its systems (points in rate order, goodput per SLO) from runs/<system>-rate<R>.json[.gz], and what
    each recorded when its server stopped from runs/<system>-extra.json."""
    import gzip
    import json

    import pytest

    from benchmarks.gpu.serve_h100 import merge
    from benchmarks.slo import goodput, parse_slo

    def summary(strict: float) -> dict:
        ms = {"p50": 10.0, "p90": 20.0}
        return {"num_completed": 2, "num_requests": 2, "output_throughput_tps": 100.0, "ttft_ms": ms, "tpot_ms": ms,
                "itl_ms": ms, "slo": {"strict": {"attainment": strict}, "relaxed": {"attainment": 1.0}}}

    slos = [parse_slo("strict").to_dict(), parse_slo("relaxed").to_dict()]
    full = {"config": {"workload": {"dataset": "azure-conv"}}, "slo": slos[0], "slos": slos,
            "systems": {"vllm": {"error": None, "points": [{"rate_rps": r, "summary": summary(1.0)} for r in (8.0, 16.0)],
                                 "goodput": {n: goodput([(8.0, 1.0), (16.0, 1.0)], n).to_dict()
                                             for n in ("strict", "relaxed")}}}}
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "compare.json").write_text(json.dumps(full))
    runs = tmp_path / "cut" / "runs"
    runs.mkdir(parents=True)
    for rate, strict in ((16.0, 0.5), (8.0, 1.0)):  # one plain, one gzipped as saved under benchmarks/results/
        text = json.dumps({"config": {"label": "bullet-slo", "base_url": "http://x", "workload": {"rate_rps": rate}},
                           "summary": summary(strict)})
        if rate == 16.0:
            runs.joinpath(f"bullet-slo-rate{rate:g}.json.gz").write_bytes(gzip.compress(text.encode()))
        else:
            runs.joinpath(f"bullet-slo-rate{rate:g}.json").write_text(text)
    runs.joinpath("notes.txt").write_text("not a run file")
    # what the system recorded when its server stopped (serve_run), kept beside the run files
    runs.joinpath("bullet-slo-extra.json").write_text(json.dumps({"startup": {"decode": {"decode_graphs": 47.6}}}))
    doc = merge([tmp_path / "a" / "compare.json", tmp_path / "cut"], tmp_path / "out")
    cut = doc["systems"]["bullet-slo"]
    assert [p["rate_rps"] for p in cut["points"]] == [8.0, 16.0] and set(doc["systems"]) == {"vllm", "bullet-slo"}
    assert cut["extra"] == {"startup": {"decode": {"decode_graphs": 47.6}}}
    assert cut["goodput"]["strict"]["measured_rps"] == 8.0 and cut["goodput"]["relaxed"]["measured_rps"] == 16.0
    assert (tmp_path / "out" / "compare.md").exists()
    # the same rate twice (a plain and a gzipped copy), or a file cut short: a one-line error naming the files
    runs.joinpath("bullet-slo-rate16.json").write_text(gzip.decompress(runs.joinpath("bullet-slo-rate16.json.gz")
                                                                       .read_bytes()).decode())
    with pytest.raises(SystemExit, match=r"bullet-slo-rate16.json(.gz)? and bullet-slo-rate16.json(.gz)? are both bullet-slo at 16 req/s"):
        merge([tmp_path / "a" / "compare.json", tmp_path / "cut"], tmp_path / "out")
    runs.joinpath("bullet-slo-rate16.json").write_text('{"config": ')
    runs.joinpath("bullet-slo-rate16.json.gz").unlink()
    with pytest.raises(SystemExit, match="bullet-slo-rate16.json: cannot read"):
        merge([tmp_path / "a" / "compare.json", tmp_path / "cut"], tmp_path / "out")


def test_merge_joins_the_rates_of_a_system_swept_in_two_calls(tmp_path):
    """A system in two compare.json files (more rates swept in a later call): its points are joined in rate order
    (the first file's point kept where both have a rate) and its goodput computed again over all of them."""
    import json

    from benchmarks.gpu.serve_h100 import merge
    from benchmarks.slo import goodput, parse_slo

    def summary(attained: float) -> dict:
        ms = {"p50": 10.0, "p90": 20.0}
        return {"num_completed": 2, "num_requests": 2, "output_throughput_tps": 100.0, "ttft_ms": ms, "tpot_ms": ms,
                "itl_ms": ms, "slo": {"strict": {"attainment": attained}, "relaxed": {"attainment": attained}}}

    slos = [parse_slo("strict").to_dict(), parse_slo("relaxed").to_dict()]

    def doc(points: dict[float, float]) -> dict:
        pairs = sorted(points.items())
        return {"config": {"workload": {"dataset": "azure-conv"}}, "slo": slos[0], "slos": slos,
                "systems": {"bullet-slo-relaxed": {"error": None,
                                                   "points": [{"rate_rps": r, "summary": summary(a)} for r, a in pairs],
                                                   "goodput": {n: goodput(pairs, n).to_dict() for n in ("strict", "relaxed")}}}}

    for name, points in (("low", {8.0: 1.0, 40.0: 0.95}), ("high", {40.0: 0.1, 48.0: 0.8, 56.0: 0.7})):
        (tmp_path / name).mkdir()
        made = doc(points)
        if name == "high":
            made["systems"]["bullet-slo-relaxed"]["error"] = "rate 64: server died"
        (tmp_path / name / "compare.json").write_text(json.dumps(made))
    merged = merge([tmp_path / "low" / "compare.json", tmp_path / "high" / "compare.json"], tmp_path / "out")
    entry = merged["systems"]["bullet-slo-relaxed"]
    assert [p["rate_rps"] for p in entry["points"]] == [8.0, 40.0, 48.0, 56.0]
    assert entry["points"][1]["summary"]["slo"]["relaxed"]["attainment"] == 0.95  # the first file's 40
    assert entry["goodput"]["relaxed"]["measured_rps"] == 40.0  # no longer ">= 40": 48 missed
    assert 40.0 < entry["goodput"]["relaxed"]["interpolated_rps"] < 48.0
    assert entry["error"] == "rate 64: server died"  # the later call's failure is not hidden


def test_graph_captures_read_from_the_nodes_metrics_pages(tmp_path):
    """serve_h100 records the engines' CUDA graphs captured after start (issue 12: none) from Ray's exporters."""
    page = ("# HELP ray_bullet_graph_captures_serving CUDA graphs captured after start.\n"
            "# TYPE ray_bullet_graph_captures_serving gauge\n"
            'ray_bullet_graph_captures_serving{engine="a",model_name="m"} 0.0\n'
            'ray_bullet_graph_captures_serving{engine="b",model_name="m"} 2.0\n'
            "# TYPE ray_bullet_num_requests_waiting gauge\n"
            'ray_bullet_num_requests_waiting{engine="a",model_name="m"} 7.0\n')
    pages = [page, "# TYPE other gauge\nother 1.0\n"]

    discovery = tmp_path / "discovery.json"
    with serve_pages(pages) as port:
        discovery.write_text(f'[{{"labels": {{"job": "ray"}}, "targets": ["127.0.0.1:{port}"]}}]')
        assert serve_h100.graph_captures_serving(discovery, timeout_s=5.0) == 2
        pages.pop(0)  # a page without the gauge
        assert serve_h100.graph_captures_serving(discovery, timeout_s=5.0) is None
    assert serve_h100.graph_captures_serving(tmp_path / "missing.json") is None
    discovery.write_text('[{"labels": {"job": "ray"}, "targets": ["127.0.0.1:9"]}]')  # nothing listens on port 9
    assert serve_h100.graph_captures_serving(discovery, timeout_s=1.0) is None


def test_the_engines_garbage_collections_are_read_from_its_stats_route():
    """serve_h100 keeps each of our systems' GC totals per process (front and workers) from /v1/internal/stats."""
    gc = {"processes": {"front": {"seconds": 0.5, "collections": 40}, "decode": {"seconds": 0.01, "collections": 9}},
          "front_frozen": 123456}
    pages = [json.dumps({"num_waiting": 0, "gc": gc})]
    with serve_pages(pages) as port:
        assert serve_h100.engine_gc(f"http://127.0.0.1:{port}") == gc
        pages[0] = json.dumps({"num_waiting": 0})  # an engine without the entry
        assert serve_h100.engine_gc(f"http://127.0.0.1:{port}") is None
        pages[0] = "not json"
        assert serve_h100.engine_gc(f"http://127.0.0.1:{port}") is None
    assert serve_h100.engine_gc("http://127.0.0.1:9", timeout_s=1.0) is None  # nothing listens on port 9


def test_an_engine_suffix_can_set_serve_runs_environment():
    """+attnoverlap / +attnholistic reach the engine through `serve run`'s environment, beside --serve-env's."""
    from types import SimpleNamespace

    from benchmarks.gpu.serve_h100 import make_system

    args = SimpleNamespace(ready_timeout_s=10, base_yaml=GPU_YAML, check_requests=0, check_prompt_tokens=16,
                           serve_env={"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"})
    on = make_system("chunked-2048+attnoverlap+direct", args).extra["serve_env"]
    assert on == {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "BULLET_RAY_MIXED_ATTENTION": "overlap"}
    holistic = make_system("chunked-2048+attnholistic+direct", args).extra["serve_env"]
    assert holistic == {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "BULLET_RAY_MIXED_ATTENTION": "holistic"}
    assert make_system("chunked-2048+direct", args).extra["serve_env"] == {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}


def test_environment_suffixes_combine_with_an_engine_suffix(tmp_path):
    """+ragged / +scatter (and the +attn<mode> ones) set `serve run`'s environment and stack with one engine suffix:
    the shipped system's +lt keeps its GEMM setting beside the ragged prefill; a suffix twice is refused."""
    import pytest
    import yaml

    from benchmarks.gpu.serve_h100 import parse_system, suffix_env, system_yaml

    shipped = "bullet-slo-margin50-pl10-mot-fb1000+lt+ragged+direct"
    assert parse_system(shipped) == ("bullet-slo-margin50-pl10-mot-fb1000", "lt", True)
    assert suffix_env(shipped) == {"BULLET_RAY_PREFILL_ATTENTION": "ragged"}
    engine = yaml.safe_load(system_yaml(shipped, tmp_path).read_text())["applications"][0]["args"]["engine"]
    assert engine["prefill_gemm"] == "cublaslt"
    assert suffix_env("chunked-8192+scatter+ragged") == {"BULLET_RAY_KV_WRITE": "scatter",
                                                          "BULLET_RAY_PREFILL_ATTENTION": "ragged"}
    assert parse_system("chunked-2048+attnoverlap+direct") == ("chunked-2048", "attnoverlap", True)
    assert suffix_env("chunked-2048+vllminit+paged+direct") == {"BULLET_RAY_DUMMY_INIT": "uniform",
                                                               "BULLET_RAY_PREFILL_ATTENTION": "paged"}
    assert suffix_env("bullet-slo-margin50-pl10-mot-fb1000-dp32+lt+directplan+direct") == {
        "BULLET_RAY_DECODE_PLAN": "direct"}
    assert parse_system("bullet-slo-margin50-pl10-mot-fb1000-dp32+lt+directplan+direct") == (
        "bullet-slo-margin50-pl10-mot-fb1000-dp32", "lt", True)
    # stacked without +direct: through Serve's proxy (the stacking once made every such system direct)
    assert parse_system("chunked-8192+lt+ragged") == ("chunked-8192", "lt", False)
    assert parse_system("chunked-8192+scatter+ragged")[2] is False
    for bad in ("chunked-2048+ragged+ragged", "chunked-2048+lt+sync", "chunked-2048+direct+direct",
                "chunked-2048+attnoverlap+attnholistic", "chunked-2048+ragged+paged"):
        with pytest.raises(SystemExit):
            parse_system(bad)


def test_the_workload_seed_reaches_the_client():
    """--seed: another sample of the same workload (arrivals and prompts), for the spread between runs."""
    import argparse
    import dataclasses

    from benchmarks.gpu.serve_h100 import bench_config
    from bullet_ray.bench.traces import build_workload

    args = argparse.Namespace(dataset="random", num_prompts=8, seed=0, trace_path=None, slo="strict,relaxed")
    first = bench_config(args)
    assert first.workload.seed == 0 and first.slos == ["strict", "relaxed"] and first.workload.num_prompts == 8
    again = bench_config(argparse.Namespace(**{**vars(args), "seed": 1}))
    assert again.workload.seed == 1
    a, b = (build_workload(dataclasses.replace(c.workload, rate_rps=8.0)) for c in (first, again))
    assert [r.arrival_s for r in a] != [r.arrival_s for r in b]


def test_serve_run_stops_without_direct_ingress_draining_period(monkeypatch):
    """serve run's environment: direct ingress' 30 s draining period cut to 1 s (nothing routes to a benchmark's
    replica once it stops), unless the caller's environment or --serve-env sets it; direct ingress on for '+direct'."""
    from benchmarks import direct_ingress
    from benchmarks.gpu.serve_h100 import STOP_ENV, serve_run_env

    (key,) = STOP_ENV
    monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv(direct_ingress.ENV_VAR, raising=False)
    env = serve_run_env({"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}, is_direct=True)
    assert env[key] == "1" and env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1" and env[direct_ingress.ENV_VAR] == "1"
    assert serve_run_env({key: "30"}, is_direct=False)[key] == "30"
    assert direct_ingress.ENV_VAR not in serve_run_env({}, is_direct=False)
    monkeypatch.setenv(key, "5")
    assert serve_run_env({}, is_direct=False)[key] == "5"


def test_backlog_batch_modifier_applies_to_any_bullet_slo_system(tmp_path):
    """<bullet-slo system>-bb<tokens>: the system as named, plus engine.prefill_backlog_batch_tokens; the YAML is a
    valid engine config; a bad count, or the modifier on another system, is a one-line error naming the form."""
    from bullet_ray.serve.config import EngineArgs

    margin = _engine(system_yaml("bullet-slo-margin50-bb8192+direct", tmp_path))
    assert (margin["split_policy"], margin["ttft_margin_ms"], margin["prefill_backlog_batch_tokens"]) == ("slo", 50, 8192)
    assert margin["step_log_path"].endswith("bullet-slo-margin50-bb8192+direct-steps.jsonl")
    cfg = EngineArgs(**margin).to_engine_config()
    assert cfg.prefill_backlog_batch_tokens == 8192
    plain = _engine(system_yaml("bullet-slo-bb4096", tmp_path))
    assert (plain["split_policy"], plain["prefill_backlog_batch_tokens"]) == ("slo", 4096)
    assert "prefill_backlog_batch_tokens" not in _engine(system_yaml("bullet-slo", tmp_path))
    for bad in ("bullet-slo-bbx", "bullet-slo-bb0", "chunked-2048-bb4096"):
        with pytest.raises(SystemExit, match="bb"):
            system_yaml(bad, tmp_path)


def test_lt_suffixes_route_the_prefill_gemm_of_engine_systems(tmp_path):
    """+lt / +ltall: engine.prefill_gemm cublaslt / cublaslt-all on a bullet or chunked system (a valid engine config
    on the GPU YAML)."""
    from bullet_ray.serve.config import EngineArgs

    engine = _engine(system_yaml("bullet-slo-margin50+lt+direct", tmp_path))
    assert (engine["prefill_gemm"], engine["ttft_margin_ms"]) == ("cublaslt", 50)
    assert EngineArgs(**engine).to_engine_config().prefill_gemm == "cublaslt"
    assert _engine(system_yaml("bullet-slo+ltall", tmp_path))["prefill_gemm"] == "cublaslt-all"
    assert _engine(system_yaml("bullet-slo-margin50+direct", tmp_path))["prefill_gemm"] == "cublas"
    assert _engine(system_yaml("chunked-2048+lt+direct", tmp_path))["prefill_gemm"] == "cublaslt"


def test_tgemm_suffix_is_gone(tmp_path):
    """+tgemm (engine.prefill_gemm: triton) was removed once the Triton GEMM lost to cuBLAS on every projection and
    place (benchmarks/results/partition_gemm_h200/): naming it is a one-line error."""
    with pytest.raises(SystemExit, match="unknown suffix"):
        system_yaml("bullet-slo-margin50+tgemm+direct", tmp_path)


def test_fallback_modifier_sets_the_fallback_target_beside_the_backlog_one(tmp_path):
    """<bullet-slo system>-fb<ms>: engine.ttft_fallback_ms, alone or with -bb<tokens> in either order; the YAML is
    a valid engine config; a repeated or empty modifier is a one-line error naming the form."""
    from bullet_ray.serve.config import EngineArgs

    fb = _engine(system_yaml("bullet-slo-margin50-fb1000+direct", tmp_path))
    assert (fb["ttft_margin_ms"], fb["ttft_fallback_ms"]) == (50, 1000) and "prefill_backlog_batch_tokens" not in fb
    assert EngineArgs(**fb).to_engine_config().planning_targets().fallback_target_s(100) == pytest.approx(0.95)
    for name in ("bullet-slo-margin50-bb8192-fb1000", "bullet-slo-margin50-fb1000-bb8192"):
        both = _engine(system_yaml(name, tmp_path))
        assert (both["ttft_margin_ms"], both["prefill_backlog_batch_tokens"], both["ttft_fallback_ms"]) == \
            (50, 8192, 1000)
    for bad in ("bullet-slo-fb", "bullet-slo-fb1000-fb900", "bullet-slo-fbx"):
        with pytest.raises(SystemExit, match="fb<ms>"):
            system_yaml(bad, tmp_path)


def test_plan_lead_modifier_sets_the_prefill_plan_lead_beside_another_policy(tmp_path):
    """<bullet-slo system>-pl<ms>: engine.prefill_plan_lead_ms (bullet-slo-late<ms>'s field) with a margin policy and
    +lt, a valid engine config; repeated or empty is a one-line error."""
    from bullet_ray.serve.config import EngineArgs

    engine = _engine(system_yaml("bullet-slo-margin50-pl10+lt+direct", tmp_path))
    assert (engine["ttft_margin_ms"], engine["prefill_plan_lead_ms"], engine["prefill_gemm"]) == (50, 10, "cublaslt")
    assert EngineArgs(**engine).to_engine_config().prefill_plan_lead_ms == 10
    assert engine["step_log_path"].endswith("bullet-slo-margin50-pl10+lt+direct-steps.jsonl")
    with pytest.raises(SystemExit, match="late<ms> sets the plan lead already"):
        system_yaml("bullet-slo-late20-pl10", tmp_path)
    for bad in ("bullet-slo-pl", "bullet-slo-pl10-pl5"):
        with pytest.raises(SystemExit, match="pl<ms>"):
            system_yaml(bad, tmp_path)


def test_tpot_first_modifier_sets_the_balance_rule(tmp_path):
    """<bullet-slo system>-tf: engine.split_rule.balance tpot_first, beside the other modifiers and bullet-slo-m2's
    own split-rule settings; the engine builds its split settings from it."""
    from bullet_ray.serve.config import EngineArgs

    engine = _engine(system_yaml("bullet-slo-margin50-pl10-tf+lt+direct", tmp_path))
    assert (engine["split_rule"], engine["prefill_plan_lead_ms"], engine["ttft_margin_ms"]) == (
        {"balance": "tpot_first"}, 10, 50)
    assert EngineArgs(**engine).to_engine_config().split_settings().balance == "tpot_first"
    m2 = _engine(system_yaml("bullet-slo-m2-tf", tmp_path))
    assert m2["split_rule"] == {"backlog_aim": None, "idle_decode": "fastest", "balance": "tpot_first"}
    assert "split_rule" not in _engine(system_yaml("bullet-slo-margin50-pl10", tmp_path))
    import pytest

    with pytest.raises(SystemExit, match="-tf at most once"):
        system_yaml("bullet-slo-margin50-tf-tf", tmp_path)


def test_max_on_time_modifier_sets_the_prefill_order(tmp_path):
    """<bullet-slo system>-mot: engine.prefill_order max_on_time, beside -tf and the other modifiers."""
    import pytest

    from bullet_ray.serve.config import EngineArgs

    engine = _engine(system_yaml("bullet-slo-margin50-pl10-mot+lt+direct", tmp_path))
    assert (engine["prefill_order"], engine["prefill_plan_lead_ms"], engine["ttft_margin_ms"]) == ("max_on_time", 10, 50)
    assert EngineArgs(**engine).to_engine_config().prefill_order == "max_on_time"
    both = _engine(system_yaml("bullet-slo-margin50-pl10-tf-mot", tmp_path))
    assert (both["prefill_order"], both["split_rule"]) == ("max_on_time", {"balance": "tpot_first"})
    assert "prefill_order" not in _engine(system_yaml("bullet-slo-margin50-pl10", tmp_path))
    with pytest.raises(SystemExit, match="-mot at most once"):
        system_yaml("bullet-slo-margin50-mot-mot", tmp_path)
    # -ff: the fallback-first order beside the 1 s fallback target; one prefill order per system
    first = _engine(system_yaml("bullet-slo-margin50-pl10-ff-fb1000+lt+direct", tmp_path))
    assert (first["prefill_order"], first["ttft_fallback_ms"]) == ("fallback_first", 1000)
    assert EngineArgs(**first).to_engine_config().prefill_order == "fallback_first"
    with pytest.raises(SystemExit, match="one of them"):
        system_yaml("bullet-slo-margin50-mot-ff", tmp_path)
    with pytest.raises(SystemExit, match="give -fb<ms> too"):
        system_yaml("bullet-slo-margin50-pl10-ff+lt+direct", tmp_path)


def test_floor_modifier_sets_the_split_ladder_from_a_decode_floor(tmp_path):
    """<bullet-slo system>-fl<SMs>: engine.decode_sm_counts from that floor in steps of 8 to the default ladder's top
    (112 of 132 SMs), a valid engine config; a floor off the 8-SM grid, outside it or repeated is a one-line
    error."""
    from bullet_ray.serve.config import EngineArgs

    engine = _engine(system_yaml("bullet-slo-relaxed-pl10-fl8-mot+lt+direct", tmp_path))
    assert engine["decode_sm_counts"] == list(range(8, 113, 8)) and engine["prefill_order"] == "max_on_time"
    assert (engine["ttft_target_ms"], engine["prefill_plan_lead_ms"]) == (1000.0, 10)
    assert EngineArgs(**engine).to_engine_config().decode_sm_counts == tuple(range(8, 113, 8))
    assert "decode_sm_counts" not in _engine(system_yaml("bullet-slo-relaxed-pl10-mot+lt+direct", tmp_path))
    for bad, why in (("bullet-slo-fl12", "multiple of 8"), ("bullet-slo-fl0", "fl<SMs>"),
                     ("bullet-slo-fl120", r"\[8, 112\]"), ("bullet-slo-fl8-fl16", "fl<SMs>")):
        with pytest.raises(SystemExit, match=why):
            system_yaml(bad, tmp_path)


def test_share_modifier_sets_the_saturation_share(tmp_path):
    """<bullet-slo system>-sat<percent>: engine.prefill_saturation_share, a valid engine config; out of 1-100 or
    repeated is a one-line error."""
    from bullet_ray.serve.config import EngineArgs

    engine = _engine(system_yaml("bullet-slo-margin50-pl10-mot-fb1000-sat99+lt+direct", tmp_path))
    assert engine["prefill_saturation_share"] == 0.99 and engine["ttft_fallback_ms"] == 1000
    assert EngineArgs(**engine).to_engine_config().prefill_saturation_share == 0.99
    assert "prefill_saturation_share" not in _engine(system_yaml("bullet-slo-margin50-pl10-mot+lt+direct", tmp_path))
    for bad in ("bullet-slo-sat0", "bullet-slo-sat101", "bullet-slo-sat90-sat95"):
        with pytest.raises(SystemExit, match="sat<percent>"):
            system_yaml(bad, tmp_path)


def test_idle_decide_modifier_sets_the_idle_wait(tmp_path):
    """<bullet-slo system>-iw<ms>: engine.prefill_idle_decide_ms, a valid engine config; 0, over the 500 ms idle wait
    or repeated is a one-line error; the engine refuses the same bounds naming the field."""
    from pydantic import ValidationError

    from bullet_ray.config import EngineConfig
    from bullet_ray.errors import ConfigError
    from bullet_ray.serve.config import EngineArgs

    engine = _engine(system_yaml("bullet-slo-margin50-pl10-mot-fb1000-iw5+lt+direct", tmp_path))
    assert engine["prefill_idle_decide_ms"] == 5 and engine["prefill_order"] == "max_on_time"
    assert EngineArgs(**engine).to_engine_config().prefill_idle_decide_ms == 5
    assert "prefill_idle_decide_ms" not in _engine(system_yaml("bullet-slo-margin50-pl10-mot+lt+direct", tmp_path))
    for bad in ("bullet-slo-iw0", "bullet-slo-iw501", "bullet-slo-iw5-iw2"):
        with pytest.raises(SystemExit, match=r"iw<ms>"):
            system_yaml(bad, tmp_path)
    assert EngineConfig().prefill_idle_decide_ms is None
    for bad in (0, 501):
        with pytest.raises(ConfigError, match=r"^prefill_idle_decide_ms: must be > 0 and <= 500"):
            EngineConfig(prefill_idle_decide_ms=bad)
        with pytest.raises(ValidationError, match="prefill_idle_decide_ms"):
            EngineArgs(prefill_idle_decide_ms=bad)


def test_serve_env_takes_pairs_in_one_flag_or_many(capsys):
    """`--serve-env A=1 B=2` (one flag, two pairs: refused before, a lost GPU call) and repeated flags both work."""
    from benchmarks.gpu.serve_h100 import main, serve_env_of

    assert serve_env_of(["A=1", "B=x=y", "C="]) == {"A": "1", "B": "x=y", "C": ""}
    with pytest.raises(ValueError, match="'B'"):
        serve_env_of(["A=1", "B"])
    with pytest.raises(SystemExit) as e:
        main(["--serve-env", "A=1", "B", "--serve-env", "C=2", "--systems", "chunked-2048"])
    assert e.value.code == 2 and "--serve-env: give KEY=VALUE, got 'B'" in capsys.readouterr().err


def test_mixed_fallback_modifiers_set_the_fallback_beside_any_policy(tmp_path):
    """<bullet-slo system>-mx<tokens>[-mc<tokens>]: engine.mixed_fallback_tokens (and mixed_chunk_tokens) beside the
    shipped policy's own fields, a valid engine config with the mixed fallback on; -mc without a fallback, -mx beside
    bullet-slo-mixed<tokens>, or either repeated is a one-line error."""
    from bullet_ray.serve.config import EngineArgs

    engine = _engine(system_yaml("bullet-slo-margin50-pl10-mot-fb1000-mx8192-mc1024+lt+direct", tmp_path))
    assert engine["mixed_fallback_tokens"] == 8192 and engine["mixed_chunk_tokens"] == 1024
    assert engine["ttft_margin_ms"] == 50 and engine["prefill_order"] == "max_on_time"
    assert engine["ttft_fallback_ms"] == 1000
    config = EngineArgs(**engine).to_engine_config()
    assert config.uses_mixed_fallback and config.piecewise_limit("decode") == 1024
    assert "mixed_chunk_tokens" not in _engine(system_yaml("bullet-slo-margin50-mx8192", tmp_path))
    assert "mixed_fallback_tokens" not in _engine(system_yaml("bullet-slo-margin50-pl10-mot+lt+direct", tmp_path))
    assert _engine(system_yaml("bullet-slo-mixed4096-mc512", tmp_path))["mixed_chunk_tokens"] == 512
    for bad, why in (("bullet-slo-margin50-mc1024", "give -mx<tokens>"), ("bullet-slo-mixed4096-mx8192", "already"),
                     ("bullet-slo-mx8192-mx4096", "mx<tokens>"), ("bullet-slo-mx0", "mx<tokens>"),
                     ("bullet-slo-mx8192-mc512-mc256", "each once"), ("bullet-slo-mx8192-mc8", "tokens >= 16")):
        with pytest.raises(SystemExit, match=why):
            system_yaml(bad, tmp_path)


def test_decode_pieces_modifier_sets_the_pieces(tmp_path):
    """<bullet-slo system>-dp<pieces>: engine.decode_pieces (>= 2), a valid engine config; 1, 0 or repeated is a
    one-line error; the engine and the Serve arguments refuse out-of-range values naming the field."""
    from pydantic import ValidationError

    from bullet_ray.config import EngineConfig
    from bullet_ray.errors import ConfigError
    from bullet_ray.serve.config import EngineArgs

    engine = _engine(system_yaml("bullet-slo-margin50-pl10-mot-fb1000-dp8+lt+direct", tmp_path))
    assert engine["decode_pieces"] == 8 and engine["prefill_order"] == "max_on_time"
    assert EngineArgs(**engine).to_engine_config().decode_pieces == 8
    assert "decode_pieces" not in _engine(system_yaml("bullet-slo-margin50-pl10-mot+lt+direct", tmp_path))
    for bad in ("bullet-slo-dp1", "bullet-slo-dp0", "bullet-slo-dp4-dp2"):
        with pytest.raises(SystemExit, match=r"dp<pieces>"):
            system_yaml(bad, tmp_path)
    assert EngineConfig().decode_pieces == 1
    with pytest.raises(ConfigError, match=r"^decode_pieces: must be in \[1, 256\]"):
        EngineConfig(decode_pieces=257)
    with pytest.raises(ValidationError, match="decode_pieces"):
        EngineArgs(decode_pieces=0)


def test_nogc_modifier_leaves_the_heaps_unfrozen(tmp_path):
    """<bullet-slo system>-nogc: engine.gc_freeze false (the engine freezes each worker's heap by default), a valid
    engine config beside -dp<pieces>; repeated is a one-line error."""
    from bullet_ray.config import EngineConfig
    from bullet_ray.serve.config import EngineArgs

    engine = _engine(system_yaml("bullet-slo-margin50-pl10-mot-fb1000-dp32-nogc+lt+direct", tmp_path))
    assert engine["gc_freeze"] is False and engine["decode_pieces"] == 32
    assert EngineArgs(**engine).to_engine_config().gc_freeze is False
    assert "gc_freeze" not in _engine(system_yaml("bullet-slo-margin50-pl10-mot-fb1000-dp32+lt+direct", tmp_path))
    assert EngineConfig().gc_freeze is True and EngineArgs().to_engine_config().gc_freeze is True
    with pytest.raises(SystemExit, match="-nogc at most once"):
        system_yaml("bullet-slo-nogc-nogc", tmp_path)
