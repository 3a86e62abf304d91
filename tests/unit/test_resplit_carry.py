"""benchmarks/gpu/resplit_carry: folders repacked to a size, and never emptied when nothing fits."""

from __future__ import annotations

import pytest

from benchmarks.gpu import resplit_carry
from benchmarks.gpu.resplit_carry import main, resplit


def _carry(tmp_path):
    carry = tmp_path / ".carry"
    for folder, files in {"ray-a": {"x.whl": 30, "y.whl": 30}, "ray-b": {"z.whl.part.00": 40, "z.whl.part.01": 20},
                          "azure": {"conv.csv": 5}}.items():
        (carry / folder).mkdir(parents=True)
        for name, size in files.items():
            (carry / folder / name).write_bytes(bytes([len(name)]) * size)
    return carry


def _contents(carry):
    files = {f.name: f.read_bytes() for d in carry.glob("ray-*") for f in d.iterdir()}
    z = b"".join(files.pop(n) for n in sorted(n for n in list(files) if n.startswith("z.whl")))
    return files, z


@pytest.mark.parametrize(("max_bytes", "folders"), [(64, 2), (50, 3)])
def test_folders_are_repacked_under_the_size_and_a_cut_wheel_rejoined(tmp_path, max_bytes, folders):
    carry = _carry(tmp_path)
    before = _contents(carry)
    assert resplit(carry, max_bytes) == {"ray": folders}
    assert all(sum(f.stat().st_size for f in d.iterdir()) <= max_bytes for d in carry.glob("ray-*"))
    assert _contents(carry) == before  # every byte kept; the cut wheel rejoins to the same file
    whole = [f for d in carry.glob("ray-*") for f in d.iterdir() if f.name == "z.whl"]
    assert bool(whole) == (max_bytes >= 60)  # cut again only when it is over the size
    assert (carry / "azure" / "conv.csv").stat().st_size == 5  # other folders stay


def test_nothing_is_emptied_when_nothing_fits(tmp_path, monkeypatch, capsys):
    carry = _carry(tmp_path)
    with pytest.raises(ValueError, match="max_bytes"):
        resplit(carry, 0)
    monkeypatch.setattr(resplit_carry, "tracked_bytes", lambda: 200 * 2**20)  # the tree alone is over a call
    assert main(["--carry", str(carry)]) == 2
    assert "move benchmarks/results out" in capsys.readouterr().err
    assert main(["--carry", str(carry), "--max-mb", "-1"]) == 2
    assert sorted(f.name for f in (carry / "ray-a").iterdir()) == ["x.whl", "y.whl"]  # untouched
