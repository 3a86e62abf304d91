"""benchmarks.gpu.prepare_lease: .carry/ parts packed into device calls that fit beside the tree."""

import pytest

from benchmarks.gpu import prepare_lease
from benchmarks.gpu.prepare_lease import MIB, pack


def test_pack_fills_calls_first_fit_decreasing_under_the_budget_and_the_path_limit():
    parts = {"flashinfer-a": 48 * MIB, "flashinfer-b": 15 * MIB, "vllm-i": 19 * MIB, "azure": 1 * MIB,
             "lt-cache": MIB // 10, "ray-a": 48 * MIB, "ray-b": 53 * MIB}
    calls = pack(parts, budget=58 * MIB)
    assert sorted(n for c in calls for n in c) == sorted(parts)  # every part once
    assert all(sum(parts[n] for n in c) <= 58 * MIB for c in calls)
    # largest first, each into the first call with room: the small parts fill in beside the large ones
    assert calls == [["azure", "lt-cache", "ray-b"], ["flashinfer-a"], ["ray-a"], ["flashinfer-b", "vllm-i"]]
    # eight small parts at most per call (a call names at most 8 carry paths)
    many = {f"p{i}": MIB for i in range(10)}
    assert [len(c) for c in pack(many, budget=58 * MIB)] == [8, 2]


def test_pack_refuses_a_part_larger_than_a_call():
    with pytest.raises(ValueError, match="ray-b: larger than one call's room"):
        pack({"ray-b": 60 * MIB, "azure": MIB}, budget=58 * MIB)


def test_main_refuses_without_wheels_or_with_the_results_in_the_tree(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert prepare_lease.main([]) == 2
    assert "fetch_wheels.sh" in capsys.readouterr().err
    (tmp_path / ".carry" / "flashinfer-a").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    assert prepare_lease.main([]) == 2
    assert "move it out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prepare_lease.main(["--jit", str(tmp_path / "nowhere.tgz")])
    assert "--jit" in capsys.readouterr().err
