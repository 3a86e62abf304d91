"""benchmarks.saturation_sizes: the policy's batch sizes by profile, share and SM count."""

from __future__ import annotations

from benchmarks import saturation_sizes
from bullet_ray.models.loader import resolve_source
from bullet_ray.perf.model import PerfModel
from bullet_ray.perf.profile import PACKAGE_DIR, load_profile
from bullet_ray.perf.roofline import H100_SXM
from bullet_ray.policy.bullet import BulletPolicy
from bullet_ray.policy.slo import SloTargets

H200 = PACKAGE_DIR / "nvidia-h200__llama-3-1-8b__bfloat16.json"


def test_sizes_are_the_policys_and_grow_with_the_share():
    model = PerfModel(resolve_source("dummy:llama-3.1-8b").config, H100_SXM)
    table = saturation_sizes.sizes(model, [0.9, 0.95, 0.99], [92, 116], 8192)
    for i, sms in enumerate((92, 116)):
        column = [table[share][i] for share in (0.9, 0.95, 0.99)]
        assert column == sorted(column) and column[-1] <= 8192
        policy = BulletPolicy(model, [16, 40], 132, SloTargets(0.5, 0.025), token_cap=8192)
        assert policy.saturation_tokens(sms, True, now_s=0.0) == table[0.95][i]  # what the policy itself stops at


def test_cli_prints_a_row_per_profile_and_share(capsys):
    assert saturation_sizes.main([str(H200), "--shares", "0.95,0.99", "--sms", "116"]) == 0
    out = capsys.readouterr().out
    model = PerfModel.from_profile(load_profile(H200), resolve_source("dummy:llama-3.1-8b").config)
    expected = model.saturation_tokens(116, share=0.95, max_tokens=8192, other_busy=True)
    assert f"| measured, {load_profile(H200).date} | 0.95 | {expected:,} |" in out
    assert out.count("| measured,") == 2


def test_bad_values_are_one_line_errors(capsys, tmp_path):
    for argv in ([str(H200), "--shares", "1.5"], [str(H200), "--sms", "x"], [str(tmp_path / "none.json")],
                 [str(H200), "--token-cap", "0"]):
        assert saturation_sizes.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("saturation_sizes: error:")
