"""A bench run names the code it measured: a digest of the package's sources, which a copied working tree
with an older .git (the GPU machine's) cannot misreport, and whether the package differs from git's HEAD."""

from __future__ import annotations

from bullet_ray.bench.serve_bench import BenchConfig, environment, source_digest


def test_source_digest_follows_the_python_sources_only(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    first = source_digest(pkg)
    assert len(first) == 16 and source_digest(pkg) == first
    (pkg / "notes.md").write_text("not code")
    assert source_digest(pkg) == first
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    assert source_digest(pkg) != first
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    (pkg / "sub" / "b.py").rename(pkg / "b2.py")  # same content, another path
    assert source_digest(pkg) != first


def test_environment_records_the_digest_and_the_commit():
    env = environment(BenchConfig(base_url="http://127.0.0.1:1"), "m")
    assert env["bench_source_digest"] == source_digest()
    assert env["bench_git_dirty"] in (True, False, None)
    if env["bench_git_commit"] is None:
        assert env["bench_git_dirty"] is None
