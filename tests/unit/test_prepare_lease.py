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


def test_main_packs_the_parts_beside_the_tree(tmp_path, monkeypatch, capsys):
    """A successful run in a repository with benchmarks/results moved out: the wheel folders packed into calls,
    --no-vllm leaving vllm-* out, SmolLM2 parts only with --smollm2, loose files in .carry ignored."""
    import subprocess

    monkeypatch.chdir(tmp_path)
    subprocess.run(["git", "init", "-q"], check=True)
    (tmp_path / "README.md").write_bytes(b"x" * 3_000_000)  # the tree: 3 MB
    subprocess.run(["git", "add", "README.md"], check=True)
    for name, mb in (("flashinfer-a", 40), ("flashinfer-b", 15), ("ray-a", 30), ("vllm-a", 20), ("smol-a", 20)):
        (tmp_path / ".carry" / name).mkdir(parents=True)
        (tmp_path / ".carry" / name / "part").write_bytes(b"\0" * (mb * 1_000_000))
    (tmp_path / ".carry" / "loose.txt").write_text("not a part")
    assert prepare_lease.main(["--no-vllm"]) == 0
    out = capsys.readouterr().out
    assert "tree 3.0 MB; 3 parts" in out and "in 2 stage calls" in out  # 40 + 15; 30 (each call <= 63.1 MB)
    assert ".carry/flashinfer-a" in out and "vllm" not in out and "smol" not in out and "loose" not in out


def test_the_lt_cache_is_found_where_the_procedure_moves_the_results(tmp_path):
    """The lease's procedure moves benchmarks/results to ../results_stash before prepare_lease runs: the tuned
    cuBLASLt choices are taken from there (they were silently left out before)."""
    from benchmarks.gpu.prepare_lease import LT_CACHE, make_small_parts

    root = tmp_path / "main"
    root.mkdir()
    stash = tmp_path / "results_stash" / LT_CACHE
    stash.parent.mkdir(parents=True)
    stash.write_text('{"choices": 1}')
    make_small_parts(root, smollm2=False, jit=None)
    assert (root / ".carry" / "lt-cache" / "lt_gemm.json").read_text() == '{"choices": 1}'
