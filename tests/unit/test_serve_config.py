"""Every deploy/*.yaml is a valid Serve config whose args build the application (no Ray cluster)."""

from __future__ import annotations

import os

import pytest
import yaml
from pydantic import ValidationError
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.schema import ServeDeploySchema

from bullet_ray.serve import build_app
from bullet_ray.serve.config import GRPC_SERVICER_FUNCTION, BulletAppConfig

DEPLOY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "deploy")
CONFIGS = ["local.yaml", "gpu.yaml", "node.yaml", "cluster.yaml"]


def _load(name: str) -> dict:
    with open(os.path.join(DEPLOY, name)) as f:
        return yaml.safe_load(f)


def _engine_options(app) -> dict:
    # colocated: the app's one deployment is the engine; else the ingress is bound to the engine deployment
    # (the engine is its first init argument)
    engine = app if app._bound_deployment.init_args[0] is None else app._bound_deployment.init_args[0]
    return engine._bound_deployment._deployment_config, engine._bound_deployment._replica_config


@pytest.mark.parametrize("name", CONFIGS)
def test_yaml_is_a_serve_config_that_builds(name):
    raw = _load(name)
    schema = ServeDeploySchema(**raw)
    assert schema.grpc_options.grpc_servicer_functions == [GRPC_SERVICER_FUNCTION]
    [app_schema] = schema.applications
    assert app_schema.import_path == "bullet_ray.serve:build_app"
    app = call_user_app_builder_with_args_if_necessary(build_app, app_schema.args)  # what `serve run` does
    deployment_config, replica_config = _engine_options(app)
    cfg = BulletAppConfig(**app_schema.args)
    assert deployment_config.num_replicas == cfg.num_engines
    if cfg.colocate_ingress:
        assert app._bound_deployment.name == "BulletEngine"
    else:
        assert app._bound_deployment._deployment_config.num_replicas == cfg.num_ingress_replicas
        # what the controller's engine budget leaves aside (AppSpec.ingress_cpus)
        assert app._bound_deployment._replica_config.ray_actor_options["num_cpus"] == cfg.ingress_num_cpus
    if cfg.engine.device == "cuda":  # bundle 0: the CPU-only replica; bundle 1: the GPU of its two workers
        assert replica_config.placement_group_bundles == [{"CPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}]
        assert replica_config.placement_group_strategy == "STRICT_PACK"
    else:
        assert replica_config.placement_group_bundles is None


def test_gpu_deployments_ship_the_measured_split_policy():
    """Every GPU deployment moves the split with the performance model (split_policy slo), aimed at the strict
    SLO with a 50 ms planning margin, the max_on_time prefill order and the 1 s fallback TTFT target: the
    configuration the serving runs measured (README status); the CPU one keeps the fixed split and the least-slack
    order, without a fallback."""
    with open(os.path.join(DEPLOY, "kuberay", "rayservice.yaml")) as f:
        kuberay = yaml.safe_load(yaml.safe_load(f)["spec"]["serveConfigV2"])
    for raw in [_load("gpu.yaml"), _load("node.yaml"), _load("cluster.yaml"), kuberay]:
        engine = BulletAppConfig(**raw["applications"][0]["args"]).engine.to_engine_config()
        assert (engine.split_policy, engine.ttft_margin_ms, engine.prefill_order) == ("slo", 50, "max_on_time")
        assert engine.ttft_fallback_ms == 1000
        assert (engine.ttft_target_ms, engine.tpot_target_ms, engine.prefill_plan_lead_ms) == (500, 25, 10)
        assert engine.max_num_batched_tokens == 8192  # the measured runs' prefill batch cap
    local = BulletAppConfig(**_load("local.yaml")["applications"][0]["args"]).engine.to_engine_config()
    assert local.split_policy in ("auto", "fixed") and local.ttft_margin_ms == 0
    assert local.prefill_order == "least_slack" and local.ttft_fallback_ms is None


def test_node_and_cluster_configs_use_every_proxy():
    for name in ("node.yaml", "cluster.yaml"):
        assert _load(name)["proxy_location"] == "EveryNode"


def test_bad_args_name_the_field():
    with pytest.raises(ValidationError, match="num_engines"):
        build_app({"num_engines": 0})
    with pytest.raises(ValidationError, match="max_queue"):
        build_app({"max_queue": 3})
    with pytest.raises(ValidationError, match="schedule"):
        build_app({"engine": {"schedule": "fifo"}})


def test_split_rule_settings_reach_the_policy_or_name_the_field():
    from bullet_ray.config import EngineConfig
    from bullet_ray.errors import ConfigError

    cfg = EngineConfig(model="dummy:tiny-llama", split_rule={"backlog_aim": None, "idle_decode": "fastest"})
    settings = cfg.split_settings()
    assert (settings.backlog_aim, settings.idle_decode, settings.aim) == (None, "fastest", 0.85)
    with pytest.raises(ConfigError, match="split_rule: unknown setting"):
        EngineConfig(model="dummy:tiny-llama", split_rule={"aimm": 0.9})
    with pytest.raises(ConfigError, match="split.aim"):
        EngineConfig(model="dummy:tiny-llama", split_rule={"aim": 1.5})
    with pytest.raises(ConfigError, match="split.max_shrink"):  # ladder entries: a whole number
        EngineConfig(model="dummy:tiny-llama", split_rule={"max_shrink": 1.5})


def test_per_prompt_token_ttft_target_validates_and_reaches_the_engine_config():
    """`ttft_target_ms_per_prompt_token`: > 0 or null, in EngineConfig (a ConfigError naming it) and at the YAML
    edge (a pydantic error naming it); set in a deployment's engine args it reaches EngineConfig and the policy's
    SloTargets (in seconds, ttft_target_ms the floor)."""
    from bullet_ray.config import EngineConfig
    from bullet_ray.errors import ConfigError
    from bullet_ray.serve.config import EngineArgs

    assert EngineConfig(model="dummy:tiny-llama").ttft_target_ms_per_prompt_token is None
    for bad in (0.0, -1.5):
        with pytest.raises(ConfigError, match="ttft_target_ms_per_prompt_token: must be > 0"):
            EngineConfig(model="dummy:tiny-llama", ttft_target_ms_per_prompt_token=bad)
        with pytest.raises(ValidationError, match="ttft_target_ms_per_prompt_token"):
            build_app({"engine": {"ttft_target_ms_per_prompt_token": bad}})
    args = BulletAppConfig(engine={"ttft_target_ms": 1.5, "tpot_target_ms": 200.0,
                                   "ttft_target_ms_per_prompt_token": 1.5}).engine
    cfg = args.to_engine_config()
    assert (cfg.ttft_target_ms, cfg.tpot_target_ms, cfg.ttft_target_ms_per_prompt_token) == (1.5, 200.0, 1.5)
    targets = cfg.slo_targets()
    assert (targets.ttft_s, targets.tpot_s, targets.ttft_per_token_s) == (0.0015, 0.2, 0.0015)
    assert targets.ttft_target_s(1000) == pytest.approx(1.5)
    assert EngineArgs().to_engine_config().slo_targets().ttft_per_token_s is None


def test_kuberay_service_embeds_a_valid_serve_config():
    with open(os.path.join(DEPLOY, "kuberay", "rayservice.yaml")) as f:
        service = yaml.safe_load(f)
    assert service["kind"] == "RayService"
    schema = ServeDeploySchema(**yaml.safe_load(service["spec"]["serveConfigV2"]))
    [app_schema] = schema.applications
    call_user_app_builder_with_args_if_necessary(build_app, app_schema.args)


def test_prometheus_reads_rays_service_discovery_file():
    with open(os.path.join(DEPLOY, "prometheus.yml")) as f:
        config = yaml.safe_load(f)
    [job] = config["scrape_configs"]
    assert job["file_sd_configs"] == [{"files": ["/tmp/ray/prom_metrics_service_discovery.json"]}]


def test_engine_args_mirror_every_engine_config_field():
    import dataclasses

    from bullet_ray.config import EngineConfig
    from bullet_ray.serve.config import EngineArgs

    assert set(EngineArgs.model_fields) == {f.name for f in dataclasses.fields(EngineConfig)}
    defaults = EngineArgs().to_engine_config()
    assert defaults == EngineConfig(model="smollm2-135m-instruct")


@pytest.mark.parametrize("engine, mps, expected", [
    ({"device": "cuda", "schedule": "bullet"}, "auto", True),
    ({"device": "cuda", "schedule": "static"}, "auto", True),
    ({"device": "cuda", "schedule": "chunked"}, "auto", False),  # one worker process: nothing to share SMs with
    ({"device": "cpu", "schedule": "bullet"}, "auto", False),
    ({"device": "cuda", "schedule": "bullet"}, "off", False),
])
def test_workers_are_mps_clients_only_for_two_process_gpu_schedules(engine, mps, expected):
    assert BulletAppConfig(engine=engine, mps=mps).uses_mps is expected


def test_gpu_yaml_workers_run_under_the_nodes_mps_daemon():
    cfg = BulletAppConfig(**_load("gpu.yaml")["applications"][0]["args"])
    assert cfg.uses_mps and cfg.mps_name == "bullet_ray"


def test_a_decode_sm_ladder_validates_and_reaches_the_engine_config():
    """`decode_sm_counts`: null (the default ladder) or ascending ints >= 1, in EngineConfig (a ConfigError naming
    it) and at the YAML edge (a pydantic error naming it); a YAML list reaches EngineConfig as a tuple; the mps backend (one fixed split) refuses one."""
    from bullet_ray.config import EngineConfig
    from bullet_ray.errors import ConfigError

    assert EngineConfig(model="dummy:tiny-llama").decode_sm_counts is None
    cfg = BulletAppConfig(engine={"decode_sm_counts": [8, 16, 24]}).engine.to_engine_config()
    assert cfg.decode_sm_counts == (8, 16, 24) and cfg.replace().decode_sm_counts == (8, 16, 24)
    for bad, why in (([], "the ladder is empty"), ([16, 8], "need strictly ascending"), ([8, 8], "need strictly ascending"),
                     ([0, 8], r"every decode SM count must be a whole number >= 1, got \[0\]"),
                     ([8.5], r"every decode SM count must be a whole number >= 1, got \[8.5\]"),
                     ("8,16", "need a list"), ([True], r"every decode SM count must be a whole number >= 1, got \[True\]")):
        with pytest.raises(ConfigError, match=f"^decode_sm_counts: {why}"):
            EngineConfig(model="dummy:tiny-llama", decode_sm_counts=bad)
    with pytest.raises(ConfigError, match="^decode_sm_counts: the mps partition backend has one fixed split"):
        EngineConfig(model="dummy:tiny-llama", decode_sm_counts=[8, 16], partition="mps")
    # at the YAML edge (build_app, i.e. `serve run`): strict whole numbers >= 1, ascending, named in the error
    for bad in ([], "many", [16, 8], [0, 8], [True, 16], [8.0], ["8"]):
        with pytest.raises(ValidationError, match="decode_sm_counts"):
            build_app({"engine": {"decode_sm_counts": bad}})


def test_a_ladder_from_a_command_line():
    """parse_ladder, behind the CLIs' ladder flags (bullet-ray profile --decode-sm-counts, replay_split --ladder):
    the counts, or a ValueError saying why, the same checks as the field's."""
    from bullet_ray.config import parse_ladder

    assert parse_ladder("8,16, 24,") == [8, 16, 24]
    for bad, why in (("8,x", r"need comma-separated whole numbers, got '8,x'"), ("16,8", "need strictly ascending"),
                     ("", "the ladder is empty"), ("0,8", r"whole number >= 1, got \[0\]")):
        with pytest.raises(ValueError, match=why):
            parse_ladder(bad)


def test_engine_args_cover_every_engine_config_field_with_its_default():
    """The Serve deployment's `engine:` section (EngineArgs) keeps a copy of each EngineConfig default: every field is
    there, no extra one, and an empty section builds exactly the engine's default config (a default changed in one
    place and not the other fails here)."""
    import dataclasses

    from bullet_ray.config import EngineConfig
    from bullet_ray.serve.config import EngineArgs

    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(EngineArgs.model_fields) == names
    assert EngineArgs().to_engine_config() == EngineConfig()
