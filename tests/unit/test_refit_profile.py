"""benchmarks.refit_profile on a shipped profile (CPU, no GPU): writes a refitted profile that loads, reports
errors before and after; a missing file is a one-line error (exit 2)."""

from __future__ import annotations

from benchmarks import refit_profile
from bullet_ray.perf.profile import PACKAGE_DIR, load_profile


def test_refit_writes_a_loadable_profile_and_names_a_missing_file(tmp_path, capsys):
    source = next(PACKAGE_DIR.glob("cpu__tiny-llama__*.json"))
    assert refit_profile.main([str(source), "--model", "dummy:tiny-llama", "--out", str(tmp_path)]) == 0
    refitted = load_profile(next(tmp_path.glob("*.json")))
    original = load_profile(source)
    assert len(refitted.samples) == len(original.samples)
    assert refitted.gpu == original.gpu  # one SM count on a CPU: nothing to choose the curve from
    assert "prefill.alone" in capsys.readouterr().out
    assert refit_profile.main([str(tmp_path / "nosuch.json"), "--out", str(tmp_path)]) == 2
    assert "profile:" in capsys.readouterr().err
    merged = tmp_path / "merged"
    merged.mkdir()
    assert refit_profile.main([str(source), "--model", "dummy:tiny-llama", "--add", str(source), "--out", str(merged)]) == 0
    assert len(load_profile(next(merged.glob("*.json"))).samples) == 2 * len(original.samples)
    h100 = next(PACKAGE_DIR.glob("nvidia-h100*.json"))
    assert refit_profile.main([str(source), "--model", "dummy:tiny-llama", "--add", str(h100), "--out", str(merged)]) == 2
    assert "--add:" in capsys.readouterr().err
