"""Repack the `.carry/<part>-<letter>` folders of `../shared/gpu/fetch_wheels.sh` so each, with the
repository, fits one device call (64 MiB in all). fetch_wheels packs up to 55 MB per folder, which leaves
the repository 12 MB; once benchmarks/results/ grows past that, run this before staging:

    python -m benchmarks.gpu.resplit_carry            # limit: 64 MiB minus the tracked tree, minus 1 MB
    python -m benchmarks.gpu.resplit_carry --max-mb 40

Wheels cut into `NAME.part.NN` pieces are joined and cut again (run_serve_h100.sh joins them on the
device); the folders of a part are renumbered -a, -b, ... Folders of other kinds (azure, fi-jit) stay.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CALL_LIMIT = 64 * 1024 * 1024
FOLDER_MARGIN = 1_000_000  # under the call's limit beside the tree (untracked files that travel, rounding)
MIN_FOLDER = 10_000_000  # below this a part would need dozens of calls


def tracked_bytes(root: Path = REPO) -> int:
    """Bytes of the tracked files that exist (a folder moved out of the tree for a lease counts nothing)."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout.split(b"\0")
    return sum((root / n.decode()).stat().st_size for n in names if n and (root / n.decode()).is_file())


def resplit(carry: Path, max_bytes: int) -> dict[str, int]:
    if max_bytes < 1:  # nothing would fit: every folder would be emptied and its files lost
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    groups: dict[str, list[Path]] = defaultdict(list)
    for folder in sorted(carry.iterdir()):
        prefix, _, letter = folder.name.rpartition("-")
        if folder.is_dir() and prefix and len(letter) == 1 and letter.isalpha():
            groups[prefix].append(folder)
    counts = {}
    for prefix, folders in groups.items():
        staging = carry / f".{prefix}.resplit"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        pieces: dict[str, list[Path]] = defaultdict(list)
        for folder in folders:
            for f in folder.iterdir():
                name, sep, _ = f.name.partition(".part.")
                if sep or f.stat().st_size > max_bytes:  # a whole file past the limit is cut as well
                    pieces[name].append(f)
                else:
                    shutil.move(str(f), staging / f.name)
        for name, parts in pieces.items():  # join, then cut to max_bytes
            whole = staging / name
            with open(whole, "wb") as out:
                for p in sorted(parts, key=lambda p: p.name):
                    out.write(p.read_bytes())
            if whole.stat().st_size > max_bytes:
                data = whole.read_bytes()
                whole.unlink()
                for i in range(0, len(data), max_bytes):
                    (staging / f"{name}.part.{i // max_bytes:02d}").write_bytes(data[i:i + max_bytes])
        for folder in folders:
            shutil.rmtree(folder)
        bins: list[list[Path]] = []
        sizes: list[int] = []
        for f in sorted(staging.iterdir(), key=lambda f: -f.stat().st_size):  # first fit, largest first
            s = f.stat().st_size
            for i, used in enumerate(sizes):
                if used + s <= max_bytes:
                    bins[i].append(f)
                    sizes[i] += s
                    break
            else:
                bins.append([f])
                sizes.append(s)
        for i, files in enumerate(bins):
            dest = carry / f"{prefix}-{chr(97 + i)}"
            dest.mkdir()
            for f in files:
                shutil.move(str(f), dest / f.name)
        staging.rmdir()
        counts[prefix] = len(bins)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-mb", type=float, default=None, help="bytes per folder, in MB (default: what fits)")
    parser.add_argument("--carry", type=Path, default=REPO / ".carry")
    args = parser.parse_args(argv)
    max_bytes = int(args.max_mb * 1e6) if args.max_mb else CALL_LIMIT - tracked_bytes() - FOLDER_MARGIN
    if not args.carry.is_dir():
        print(f"error: no {args.carry} (run ../shared/gpu/fetch_wheels.sh first)", file=sys.stderr)
        return 2
    if args.max_mb and max_bytes < 1:
        print(f"error: --max-mb must be > 0, got {args.max_mb:g}", file=sys.stderr)
        return 2
    if not args.max_mb and max_bytes < MIN_FOLDER:  # before this check a tree over the limit emptied every folder
        print(f"error: the tracked tree is {tracked_bytes() / 2**20:.0f} MiB, leaving {max_bytes / 1e6:.0f} MB per "
              f"folder of a 64 MiB call: move benchmarks/results out of the tree first (docs/gpu.md)", file=sys.stderr)
        return 2
    for prefix, n in resplit(args.carry, max_bytes).items():
        print(f"{prefix}: {n} folders of <= {max_bytes / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
