"""dashboards/bullet.json is what dashboards/generate.py generates, and its panels are complete."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_generator():
    spec = importlib.util.spec_from_file_location("dashboards_generate", os.path.join(ROOT, "dashboards", "generate.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["dashboards_generate"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_committed_dashboard_is_up_to_date():
    generate = load_generator()
    with open(os.path.join(ROOT, "dashboards", "bullet.json")) as f:
        assert f.read() == generate.render(), "run: python dashboards/generate.py"


def test_dashboard_has_the_variables_and_panels_operators_need():
    d = load_generator().build()
    names = {v["name"] for v in d["templating"]["list"]}
    assert {"node", "gpu", "engine", "model_name", "app", "datasource"} <= names
    titles = {p["title"] for p in d["panels"] if p["type"] == "timeseries"}
    for wanted in ("Time To First Token Latency", "Inter Token Latency", "SLO Attainment", "Goodput",
                   "Scheduler State", "Cache Utilization", "SM Split per GPU", "Decode Step Time: Predicted vs Measured",
                   "Admissions Rejected", "Controller Decisions", "Arrival Rate: Forecast vs Actual", "Engine Replicas"):
        assert wanted in titles
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    exprs = [t["expr"] for p in d["panels"] if p["type"] == "timeseries" for t in p["targets"]]
    assert all("ray_bullet_" in e for e in exprs)
    assert json.loads(json.dumps(d)) == d
