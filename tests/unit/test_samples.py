"""benchmarks.samples: ratios of goodput points over several serving folders, their mean and the goal."""

import json

import pytest

from benchmarks import samples


def write_ci(folder, points):
    """A goodput_ci.json holding only what samples reads: each system's point per SLO."""
    folder.mkdir(parents=True)
    systems = {s: {slo: {"point": {"value": v, "censored": c}} for slo, (v, c) in by_slo.items()}
               for s, by_slo in points.items()}
    (folder / "goodput_ci.json").write_text(json.dumps({"systems": systems}))


def test_mean_of_sample_ratios_and_the_goal(tmp_path, capsys):
    write_ci(tmp_path / "s1", {"a": {"strict": (30.0, None)}, "b": {"strict": (24.0, None)}})
    write_ci(tmp_path / "s2", {"a": {"strict": (26.0, None)}, "b": {"strict": (26.0, None)}})
    # censored in the third sample: listed, left out of the mean
    write_ci(tmp_path / "s3", {"a": {"strict": (48.0, ">=")}, "b": {"strict": (20.0, None)}})
    out = tmp_path / "r.json"
    rc = samples.main([str(tmp_path / s) for s in ("s1", "s2", "s3")]
                      + ["--a", "a", "--b", "b", "--slo", "strict", "--goal", "1.1", "--out", str(out)])
    assert rc == 0
    (pair,) = json.loads(out.read_text())["pairs"]
    assert [r["ratio"] for r in pair["samples"]] == [pytest.approx(1.25), pytest.approx(1.0), None]
    assert "censored" in pair["samples"][2]["left_out"]
    assert pair["n"] == 2 and pair["mean"] == pytest.approx(1.125) and pair["meets_goal"] is True
    assert "**1.125x** (2)" in capsys.readouterr().out


def test_missing_system_and_bad_arguments(tmp_path, capsys):
    write_ci(tmp_path / "s1", {"a": {"strict": (30.0, None)}})
    rows = samples.sample_ratios([("s1", samples.load_points(tmp_path / "s1"))], "a", "b", "strict")
    assert rows[0]["ratio"] is None and rows[0]["left_out"] == "b not in this sample"
    assert samples.main([str(tmp_path / "nowhere"), "--a", "a", "--b", "b"]) == 2
    assert "no goodput_ci.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        samples.main([str(tmp_path / "s1"), "--a", "a", "--b", "b,c", "--goal", "1.2"])
    assert "one per system" in capsys.readouterr().err


def test_a_censored_sample_bounds_the_ratio_and_a_second_mean(tmp_path, capsys):
    """B below the sweep's lowest rate: A/B is at least A over that rate; A below it: at most; both censored the
    same way: open. The second mean takes each bounded sample at its bound."""
    def point(value, censored=None, label=None):
        return {"value": value, "censored": censored, "label": label}

    assert samples.ratio_bound(point(25.0), point(0.0, "below", "< 24.00")) == {"side": "lower",
                                                                                "ratio": pytest.approx(25 / 24)}
    assert samples.ratio_bound(point(0.0, "below", "< 24.00"), point(30.0))["side"] == "upper"
    assert samples.ratio_bound(point(48.0, "above", ">= 48.00"), point(40.0))["side"] == "lower"
    assert samples.ratio_bound(point(0.0, "below", "< 24.00"), point(0.0, "below", "< 24.00")) is None
    assert samples.ratio_bound(point(30.0), point(0.0, "below", None)) is None  # no label: no rate to bound by
    for name, pts in (("s1", {"a": (30.0, None, None), "b": (24.0, None, None)}),
                      ("s2", {"a": (25.0, None, None), "b": (0.0, "below", "< 24.00")})):
        folder = tmp_path / name
        folder.mkdir()
        systems = {s: {"strict": {"point": {"value": v, "censored": c, "label": lab}}} for s, (v, c, lab) in pts.items()}
        (folder / "goodput_ci.json").write_text(json.dumps({"systems": systems}))
    out = tmp_path / "r.json"
    assert samples.main([str(tmp_path / "s1"), str(tmp_path / "s2"), "--a", "a", "--b", "b", "--slo", "strict",
                         "--out", str(out)]) == 0
    (pair,) = json.loads(out.read_text())["pairs"]
    assert pair["n"] == 1 and pair["mean"] == pytest.approx(1.25)
    assert pair["mean_with_bounds"] == {"side": "lower", "n": 2, "mean": pytest.approx((1.25 + 25 / 24) / 2)}
    printed = capsys.readouterr().out
    assert ">= 1.042x (censored" in printed and ">= 1.146x (2)" in printed


def test_the_means_lower_bound_over_draws(tmp_path, capsys):
    """Student's t over the samples' ratios: 1.4, 1.5, 1.3 -> mean 1.4, sd 0.1, bound 1.4 - 2.920 x 0.1 / sqrt(3)."""
    for name, a in (("s1", 28.0), ("s2", 30.0), ("s3", 26.0)):
        write_ci(tmp_path / name, {"a": {"strict": (a, None)}, "b": {"strict": (20.0, None)}})
    out = tmp_path / "r.json"
    assert samples.main([str(tmp_path / s) for s in ("s1", "s2", "s3")]
                        + ["--a", "a", "--b", "b", "--slo", "strict", "--goal", "1.25", "--out", str(out)]) == 0
    (pair,) = json.loads(out.read_text())["pairs"]
    assert pair["mean"] == pytest.approx(1.4)
    assert pair["mean_lower_95"] == pytest.approx(1.4 - 2.920 * 0.1 / 3 ** 0.5)  # 1.2314
    assert pair["meets_goal"] is True and pair["lower_95_meets_goal"] is False
    printed = capsys.readouterr().out
    assert "| 1.231x |" in printed and "1.25x: met; missed" in printed  # the mean meets the goal, its bound does not
    assert samples.mean_lower_bound([1.3]) is None  # one draw has no spread to bound by
    assert samples.mean_lower_bound([1.2] * 40) == pytest.approx(1.2)  # past the table's 30 df: its last value


def test_two_runs_of_one_draw_are_named(tmp_path, capsys):
    """Folders whose compare.json served the same workload draw (dataset, seed, prompts) are named under the table:
    the t bound would count them as independent draws."""
    for name, seed in (("m9", 1), ("m10", 1), ("m10b", 2), ("old", None)):
        write_ci(tmp_path / name, {"a": {"strict": (30.0, None)}, "b": {"strict": (24.0, None)}})
        if seed is not None:  # "old" has no compare.json: no draw known, never named
            workload = {"dataset": "azure-conv", "seed": seed, "num_prompts": 150}
            (tmp_path / name / "compare.json").write_text(json.dumps({"config": {"workload": workload}}))
    out = tmp_path / "r.json"
    assert samples.main([str(tmp_path / n) for n in ("m9", "m10b", "m10", "old")]
                        + ["--a", "a", "--b", "b", "--slo", "strict", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["same_draw"] == [{"samples": [1, 3], "draw": ["azure-conv", 1, 150]}]
    assert "samples 1, 3 served the same draw (azure-conv, seed 1, 150 prompts)" in capsys.readouterr().out


def test_plot_draws_one_panel_per_slo(tmp_path):
    """--plot writes a PNG beside the table: one panel per SLO, a censored sample drawn at its bound."""
    pytest.importorskip("matplotlib")
    write_ci(tmp_path / "s1", {"a": {"strict": (30.0, None), "relaxed": (40.0, None)},
                               "b": {"strict": (24.0, None), "relaxed": (32.0, None)}})
    write_ci(tmp_path / "s2", {"a": {"strict": (26.0, None), "relaxed": (36.0, None)},
                               "b": {"strict": (20.0, None), "relaxed": (34.0, None)}})
    (tmp_path / "s3").mkdir()  # A over the sweep's top rate: a lower bound, drawn as a hollow triangle
    censored = {"value": 48.0, "censored": "above", "label": ">= 48.00"}
    (tmp_path / "s3" / "goodput_ci.json").write_text(json.dumps({"systems": {
        "a": {slo: {"point": censored} for slo in ("strict", "relaxed")},
        "b": {slo: {"point": {"value": 40.0, "censored": None}} for slo in ("strict", "relaxed")}}}))
    png, out = tmp_path / "r.png", tmp_path / "r.json"
    assert samples.main([str(tmp_path / s) for s in ("s1", "s2", "s3")] + ["--a", "a", "--b", "b", "--goal", "1.25",
                         "--out", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    width, height = Image.open(png).size
    assert width > 1.8 * height  # two panels side by side
    pairs = json.loads(out.read_text())["pairs"]
    assert [p["slo"] for p in pairs] == ["strict", "relaxed"] and pairs[0]["mean"] == pytest.approx((1.25 + 1.3) / 2)
    assert pairs[0]["samples"][2]["bound"] == {"side": "lower", "ratio": pytest.approx(1.2)}
    with pytest.raises(SystemExit):  # no SLO left to draw a panel for
        samples.main([str(tmp_path / "s1"), "--a", "a", "--b", "b", "--slo", ",", "--plot", str(png)])


def test_every_sample_censored_the_goal_is_judged_by_the_bounds_or_left_open(tmp_path, capsys):
    """A above every sweep's top rate: no ratio, each at least its bound. The bounds' mean over the goal meets it
    ('met by the censored bounds'); under it the goal is open, not missed (the sweeps stopped too early to say)."""
    for name, a_top, b in (("s1", 48.0, 36.0), ("s2", 56.0, 40.0)):
        folder = tmp_path / name
        folder.mkdir()
        systems = {"a": {"x": {"point": {"value": a_top, "censored": "above", "label": f">= {a_top:.2f}"}}},
                   "b": {"x": {"point": {"value": b, "censored": None, "label": f"{b:.2f}"}}}}
        (folder / "goodput_ci.json").write_text(json.dumps({"systems": systems}))
    folders = [str(tmp_path / "s1"), str(tmp_path / "s2")]
    out = tmp_path / "r.json"
    assert samples.main(folders + ["--a", "a", "--b", "b", "--slo", "x", "--goal", "1.25", "--out", str(out)]) == 0
    (pair,) = json.loads(out.read_text())["pairs"]
    assert pair["mean"] is None and pair["mean_with_bounds"]["mean"] == pytest.approx((48 / 36 + 56 / 40) / 2)
    assert pair["meets_goal"] is True and "1.25x: met by the censored bounds |" in capsys.readouterr().out
    assert samples.main(folders + ["--a", "a", "--b", "b", "--slo", "x", "--goal", "1.5", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["pairs"][0]["meets_goal"] is None
    assert "1.5x: open |" in capsys.readouterr().out


def test_an_alias_joins_a_draw_that_ran_the_deployment_under_another_name(tmp_path, capsys):
    write_ci(tmp_path / "s1", {"a": {"strict": (30.0, None)}, "b": {"strict": (24.0, None)}})
    write_ci(tmp_path / "s2", {"a+x": {"strict": (26.0, None)}, "b+x": {"strict": (20.0, None)}})
    out = tmp_path / "r.json"
    args = [str(tmp_path / "s1"), str(tmp_path / "s2"), "--a", "a", "--b", "b", "--slo", "strict", "--out", str(out)]
    assert samples.main(args) == 0
    assert json.loads(out.read_text())["pairs"][0]["n"] == 1  # s2 has neither name
    assert samples.main(args + ["--alias", "a+x=a", "--alias", "b+x=b"]) == 0
    doc = json.loads(out.read_text())
    assert [r["ratio"] for r in doc["pairs"][0]["samples"]] == [pytest.approx(1.25), pytest.approx(1.3)]
    assert doc["aliases_used"] == [f"{tmp_path / 's2'}: a+x read as a", f"{tmp_path / 's2'}: b+x read as b"]
    assert "alias: " in capsys.readouterr().out
    # a folder holding both names is refused; a malformed alias names the flag
    write_ci(tmp_path / "s3", {"a": {"strict": (30.0, None)}, "a+x": {"strict": (26.0, None)}})
    assert samples.main([str(tmp_path / "s3"), "--a", "a", "--b", "b", "--alias", "a+x=a"]) == 2
    assert "--alias" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        samples.main([str(tmp_path / "s1"), "--a", "a", "--b", "b", "--alias", "a"])
    assert "--alias: expected NAME=AS" in capsys.readouterr().err
