"""cuBLASLt's ids by name (tiles, stages, cluster shapes, reduction schemes, the algorithm config attributes) and
the bounded configurations `lt_algos --enumerate` hands to cublasLtMatmulAlgoCheck (`enumerate_configs`): pure
Python, tested without a GPU; `bullet_ray/gpu/cublaslt.py` is the binding that uses them. Values from cuBLAS 13.10's
cublasLt.h (the pip nvidia-cublas wheel), checked by script against the header when written.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

# cublasLtMatmulAlgoConfigAttributes_t: (name, value, C type of the attribute)
ALGO_CONFIG_ATTRS: tuple[tuple[str, int, Any], ...] = (
    ("algo_id", 0, ctypes.c_int32),            # CUBLASLT_ALGO_CONFIG_ID
    ("tile_id", 1, ctypes.c_uint32),           # CUBLASLT_ALGO_CONFIG_TILE_ID
    ("splitk_num", 2, ctypes.c_int32),         # CUBLASLT_ALGO_CONFIG_SPLITK_NUM
    ("reduction_scheme", 3, ctypes.c_uint32),  # CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME
    ("cta_swizzling", 4, ctypes.c_uint32),     # CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING
    ("custom_option", 5, ctypes.c_uint32),     # CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION
    ("stages_id", 6, ctypes.c_uint32),         # CUBLASLT_ALGO_CONFIG_STAGES_ID
    ("inner_shape_id", 7, ctypes.c_uint16),    # CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID
    ("cluster_shape_id", 8, ctypes.c_uint16),  # CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID
)
REDUCTION_NAMES = {0: "none", 1: "inplace", 2: "compute_type", 4: "output_type"}  # cublasLtReductionScheme_t
# cublasLtMatmulTile_t (cuBLAS 13.10's cublasLt.h, ids 0-645, "rows x cols" of the output tile): 0-35 by hand, then
# the header's runs, each every `rows x cols` with cols a multiple of `step` up to a maximum, skipping shapes already
# named, then 631-645 by hand (`tile_names` rebuilt the header's table exactly when this was written)
_TILES_0_TO_35 = ("undefined 8x8 8x16 16x8 8x32 16x16 32x8 8x64 16x32 32x16 64x8 32x32 32x64 64x32 32x128 64x64 "
                  "128x32 64x128 128x64 64x256 128x128 256x64 64x512 128x256 256x128 512x64 64x96 96x64 96x128 "
                  "128x160 160x128 192x128 128x192 128x96 32x256 256x32")


def tile_names() -> dict[int, str]:
    names = _TILES_0_TO_35.split()

    def run(rows: int, step: int, max_cols: int) -> None:
        names.extend(f"{rows}x{cols}" for cols in range(step, max_cols + 1, step) if f"{rows}x{cols}" not in names)
    widest = {64: 768, 72: 640, 80: 576, 96: 512, 104: 448, 128: 384, 152: 320, 192: 256, 256: 192, 384: 128, 768: 64}
    for rows in range(8, 769, 8):  # ids 36-311: cols in steps of 64, up to widest[the first key >= rows]
        run(rows, 64, widest[min(w for w in widest if w >= rows)])
    for rows, max_cols in ((64, 760), (128, 512), (192, 336), (256, 256), (320, 200), (384, 168), (448, 144),
                           (512, 128), (576, 112), (640, 96), (704, 88), (768, 80)):  # ids 312-630: cols in steps of 8
        run(rows, 8, max_cols)
    names += ["256x512", "256x1024", "512x512", "512x1024"]
    names += [f"{rows}x1" for rows in (4, 8, 16, 24, 32, 40, 48, 64, 128, 192, 256)]
    return dict(enumerate(names))


TILE_NAMES = tile_names()
# cublasLtMatmulStages_t (29 and 30 are unused)
STAGES_NAMES = {0: "undefined", **{1 + 6 * i + j: f"{w}x{j + 1}" for i, w in enumerate((16, 32, 64, 128))
                                   for j in range(6)},
                25: "32x10", 26: "8x4", 27: "16x10", 28: "8x5", 31: "8x3", 32: "8xAUTO", 33: "16xAUTO",
                34: "32xAUTO", 35: "64xAUTO", 36: "128xAUTO", 37: "256xAUTO", 38: "768xAUTO"}  # 37, 38: 13.x
STAGES_AUTO_IDS = tuple(range(32, 39))  # CUBLASLT_MATMUL_STAGES_8xAUTO .. 768xAUTO: the library picks the depth
# cublasLtClusterShape_t (1 is unused)
_CLUSTERS = ("auto 1x1x1 2x1x1 4x1x1 1x2x1 2x2x1 4x2x1 1x4x1 2x4x1 4x4x1 8x1x1 1x8x1 8x2x1 2x8x1 16x1x1 1x16x1 "
             "3x1x1 5x1x1 6x1x1 7x1x1 9x1x1 10x1x1 11x1x1 12x1x1 13x1x1 14x1x1 15x1x1 3x2x1 5x2x1 6x2x1 7x2x1 "
             "1x3x1 2x3x1 3x3x1 4x3x1 5x3x1 3x4x1 1x5x1 2x5x1 3x5x1 1x6x1 2x6x1 1x7x1 2x7x1 1x9x1 1x10x1 1x11x1 "
             "1x12x1 1x13x1 1x14x1 1x15x1")
CLUSTER_NAMES = dict(zip([0, *range(2, 52)], _CLUSTERS.split()))
CLUSTER_IDS = {name: value for value, name in CLUSTER_NAMES.items()}


def tile_sides(tile_id: int) -> tuple[int, int] | None:
    """(rows, cols) of a cublasLtMatmulTile_t; None for TILE_UNDEFINED and ids the table does not name."""
    name = TILE_NAMES.get(tile_id, "")
    if "x" not in name:
        return None
    rows, cols = name.split("x")
    return int(rows), int(cols)


@dataclass(frozen=True)
class AlgoCaps:
    """What cublasLtMatmulAlgoCapGetAttribute says of one algorithm id (`algo_caps`)."""
    algo_id: int
    tile_ids: tuple[int, ...]  # (): the capability lists none, the algorithm takes TILE_UNDEFINED
    stages_ids: tuple[int, ...]  # (): likewise STAGES_UNDEFINED
    splitk_support: bool
    reduction_scheme_mask: int  # the cublasLtReductionScheme_t bits a split-K may use
    cta_swizzling_support: bool
    custom_option_max: int


@dataclass(frozen=True)
class EnumBounds:
    """How much of each algorithm id's capabilities `enumerate_configs` tries (lt_algos' --enumerate flags)."""
    min_tile: int = 64  # both sides of the output tile at least this (TILE_UNDEFINED and unnamed ids pass)
    max_stages: int = 4  # stages ids per tile, picked by `pick_stages`
    splitk_nums: tuple[int, ...] = (1,)  # SPLITK_NUM values; those > 1 only where SPLITK_SUPPORT
    cluster_shape_ids: tuple[int, ...] = (0, 2, 5, 3)  # auto, 1x1x1, 1x2x1, 2x1x1 (no capability lists them)
    max_custom_option: int = 0  # CUSTOM_OPTION 0 .. min(this, CUSTOM_OPTION_MAX)
    max_checks: int = 10_000  # configurations handed to cublasLtMatmulAlgoCheck per descriptor


@dataclass(frozen=True)
class AlgoChoice:
    """One configuration of one algorithm id: the cublasLtMatmulAlgoConfigAttributes_t values `configure` sets."""
    algo_id: int
    tile_id: int
    stages_id: int
    splitk_num: int
    reduction_scheme: int  # CUBLASLT_REDUCTION_SCHEME_NONE (0) unless splitk_num > 1
    cta_swizzling: int
    custom_option: int
    cluster_shape_id: int

    def settings(self) -> list[tuple[int, int]]:
        """(config attribute, value) for every attribute but the read-only id and the inner shape (left at 0)."""
        return [(attr, getattr(self, name)) for name, attr, _ in ALGO_CONFIG_ATTRS
                if name not in ("algo_id", "inner_shape_id")]


def pick_stages(stages_ids: tuple[int, ...], max_stages: int) -> tuple[int, ...]:
    """Up to `max_stages` of a capability's stages ids: its AUTO ids first (the library sizes the pipeline to the
    tile, so they fit every tile), then, for the room left, the middle id of each of that many equal slices of the
    other ids (ascending 16x1..128x6 with 4 slots: 16x4 32x4 64x4 128x4); (STAGES_UNDEFINED,) for an empty list."""
    if not stages_ids:
        return (0,)
    picked = [s for s in stages_ids if s in STAGES_AUTO_IDS][:max_stages]
    rest = [s for s in stages_ids if s not in STAGES_AUTO_IDS]
    room = min(max_stages - len(picked), len(rest))
    picked += [rest[(2 * i + 1) * len(rest) // (2 * room)] for i in range(room)] if room > 0 else []
    return tuple(picked)


@dataclass(frozen=True)
class EnumPlan:
    choices: list[AlgoChoice]  # the first bounds.max_checks configurations, in the order `enumerate_configs` gives
    num_combinations: int  # all the bounded configurations, before max_checks


def _round_robin(groups: Iterable[Iterator[AlgoChoice]]) -> Iterator[AlgoChoice]:
    alive = list(groups)
    while alive:
        still = []
        for group in alive:
            item = next(group, None)
            if item is not None:
                yield item
                still.append(group)
        alive = still


def _choice(algo_id: int, tile: int, stages: int, cluster: int, swizzle: int, split: tuple[int, int],
            option: int) -> AlgoChoice:
    return AlgoChoice(algo_id, tile, stages, split[0], split[1], swizzle, option, cluster)


def _area(tile_id: int) -> int:
    sides = tile_sides(tile_id)
    return sides[0] * sides[1] if sides else 0


def enumerate_configs(caps: list[AlgoCaps], bounds: EnumBounds) -> EnumPlan:
    """The bounded configurations of every algorithm id. Order: the ids take turns (round robin in `caps` order, so
    max_checks leaves each a share); within one id, tiles with both sides >= min_tile, largest area first (ties in
    the capability's order), then per tile its `pick_stages`, the cluster shapes (bounds' order), CTA swizzling 0
    then 1 (where supported), split-K (bounds' order; > 1 only where supported, with the lowest reduction scheme of
    the mask), custom option 0 up."""
    groups, total = [], 0
    for cap in caps:
        tiles = [t for t in cap.tile_ids if (sides := tile_sides(t)) is None or min(sides) >= bounds.min_tile]
        tiles = sorted(tiles, key=lambda t: -_area(t)) if cap.tile_ids else [0]
        scheme = cap.reduction_scheme_mask & -cap.reduction_scheme_mask  # its lowest set bit
        splits = [(k, 0 if k == 1 else scheme) for k in bounds.splitk_nums
                  if k == 1 or (k > 1 and cap.splitk_support and scheme)]
        axes: list[list[Any]] = [tiles, list(pick_stages(cap.stages_ids, bounds.max_stages)),
                                 list(bounds.cluster_shape_ids), [0, 1] if cap.cta_swizzling_support else [0], splits,
                                 list(range(min(cap.custom_option_max, bounds.max_custom_option) + 1))]
        total += len(tiles) * len(axes[1]) * len(axes[2]) * len(axes[3]) * len(splits) * len(axes[5])
        groups.append(itertools.starmap(functools.partial(_choice, cap.algo_id), itertools.product(*axes)))
    return EnumPlan(list(itertools.islice(_round_robin(groups), bounds.max_checks)), total)
