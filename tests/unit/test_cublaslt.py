"""bullet_ray.gpu.cublaslt's enumeration pieces without CUDA: the tile table, the stages pick, the bounded
configurations and their order, the config attribute sizes, the argtypes table, and LinearGemm.enumerate's flow
through a fake libcublasLt."""

import ctypes

from bullet_ray.gpu import cublaslt, cublaslt_ids
from bullet_ray.gpu.cublaslt_ids import AlgoCaps, EnumBounds


def test_tile_table_follows_cublaslt_13_10():
    names = cublaslt_ids.TILE_NAMES
    assert len(names) == 646 and names[0] == "undefined" and names[24] == "256x128"
    assert names[36] == "8x128" and names[116] == "64x192" and names[232] == "256x192" and names[311] == "768x64"
    assert names[312] == "64x16" and names[447] == "128x512" and names[570] == "448x128" and names[630] == "768x80"
    assert names[631] == "256x512" and names[634] == "512x1024" and names[635] == "4x1" and names[645] == "256x1"
    assert len(set(names.values())) == 646
    assert cublaslt_ids.tile_sides(24) == (256, 128) and cublaslt_ids.tile_sides(0) is None
    assert cublaslt_ids.tile_sides(9999) is None


def test_pick_stages_takes_auto_first_then_spreads():
    assert cublaslt_ids.pick_stages((), 4) == (0,)
    assert cublaslt_ids.pick_stages(tuple(range(1, 25)), 4) == (4, 10, 16, 22)  # 16x4 32x4 64x4 128x4
    assert cublaslt_ids.pick_stages((16, 35, 22, 36), 4) == (35, 36, 16, 22)
    assert cublaslt_ids.pick_stages((32, 33, 34, 35, 36, 37), 4) == (32, 33, 34, 35)
    assert cublaslt_ids.pick_stages((1, 2), 4) == (1, 2) and cublaslt_ids.pick_stages((1, 2, 3), 1) == (2,)


def _caps(algo_id, tiles=(15, 20, 24, 7), stages=(16, 22), splitk=False, swizzle=True, option_max=3, mask=6):
    return AlgoCaps(algo_id=algo_id, tile_ids=tiles, stages_ids=stages, splitk_support=splitk,
                    reduction_scheme_mask=mask, cta_swizzling_support=swizzle, custom_option_max=option_max)


def test_enumerate_configs_respects_the_bounds():
    bounds = EnumBounds(min_tile=64, max_stages=1, cluster_shape_ids=(2, 5), splitk_nums=(1, 4))
    plan = cublaslt_ids.enumerate_configs([_caps(66)], bounds)
    # tiles 64x64, 128x128, 256x128 (8x64 is under 64), one stages id, 2 clusters, swizzle 0/1, split-K 1 only
    assert plan.num_combinations == 3 * 1 * 2 * 2 * 1 == len(plan.choices)
    assert {c.tile_id for c in plan.choices} == {15, 20, 24} and {c.stages_id for c in plan.choices} == {22}
    assert {c.splitk_num for c in plan.choices} == {1} and {c.custom_option for c in plan.choices} == {0}
    assert {c.reduction_scheme for c in plan.choices} == {0}
    assert [c.tile_id for c in plan.choices][::4] == [24, 20, 15]  # largest area first
    first = plan.choices[0]
    assert (first.cluster_shape_id, first.cta_swizzling) == (2, 0) and plan.choices[1].cta_swizzling == 1


def test_enumerate_configs_split_k_only_where_supported_with_the_lowest_scheme():
    bounds = EnumBounds(max_stages=1, cluster_shape_ids=(0,), splitk_nums=(1, 4), max_custom_option=1)
    plan = cublaslt_ids.enumerate_configs([_caps(1, tiles=(20,), splitk=True, swizzle=False, mask=6)], bounds)
    assert [(c.splitk_num, c.reduction_scheme, c.custom_option) for c in plan.choices] == [
        (1, 0, 0), (1, 0, 1), (4, 2, 0), (4, 2, 1)]
    no_scheme = cublaslt_ids.enumerate_configs([_caps(1, tiles=(20,), splitk=True, mask=0)], bounds)
    assert {c.splitk_num for c in no_scheme.choices} == {1}


def test_enumerate_configs_takes_turns_and_caps_the_checks():
    bounds = EnumBounds(max_stages=2, cluster_shape_ids=(2,), max_checks=5)
    plan = cublaslt_ids.enumerate_configs([_caps(1, tiles=(20,)), _caps(2, tiles=(24, 20)), _caps(3, tiles=())], bounds)
    assert plan.num_combinations == 1 * 2 * 2 + 2 * 2 * 2 + 1 * 2 * 2  # tile ids () -> TILE_UNDEFINED
    assert [c.algo_id for c in plan.choices] == [1, 2, 3, 1, 2]
    assert plan.choices[2].tile_id == 0 and plan.choices[2].stages_id == 16
    all_of_them = cublaslt_ids.enumerate_configs([_caps(1, tiles=(20,)), _caps(2, tiles=(24, 20))],
                                             EnumBounds(max_stages=2, cluster_shape_ids=(2,)))
    assert [c.algo_id for c in all_of_them.choices] == [1, 2] * 4 + [2] * 4


def test_config_attribute_sizes_and_settings():
    sizes = {attr: ctypes.sizeof(ctype) for attr, ctype in cublaslt.ALGO_CONFIG_TYPES.items()}
    assert sizes == {0: 4, 1: 4, 2: 4, 3: 4, 4: 4, 5: 4, 6: 4, 7: 2, 8: 2}  # as libcublasLt 13.10 accepts them
    choice = cublaslt_ids.AlgoChoice(66, 24, 16, 1, 0, 1, 0, 5)
    assert choice.settings() == [(1, 24), (2, 1), (3, 0), (4, 1), (5, 0), (6, 16), (8, 5)]
    assert cublaslt_ids.CLUSTER_IDS["1x2x1"] == 5 and cublaslt_ids.CLUSTER_IDS["auto"] == 0
    assert cublaslt_ids.STAGES_AUTO_IDS == (32, 33, 34, 35, 36, 37, 38)


def test_signatures_cover_the_enumeration_calls():
    sigs = cublaslt.signatures()
    counts = {"cublasLtMatmulAlgoGetIds": 10, "cublasLtMatmulAlgoInit": 9, "cublasLtMatmulAlgoCapGetAttribute": 5,
              "cublasLtMatmulAlgoConfigSetAttribute": 4, "cublasLtMatmulAlgoCheck": 8}
    for name, count in counts.items():
        restype, argtypes = sigs[name]
        assert restype is ctypes.c_int and len(argtypes) == count, name
    assert sigs["cublasLtMatmulAlgoCheck"][1][-1] is ctypes.POINTER(cublaslt.HeuristicResult)


class FakeLt:
    """The libcublasLt calls LinearGemm and the enumeration make, on ctypes objects: algorithm ids 66 and 67 (67's
    init fails), a check that accepts tile 24 only and asks 2 MiB of workspace of cluster 2x1x1."""

    def __init__(self):
        self.set_sizes = {}

    def __getattr__(self, name):
        return lambda *args: 0  # descriptors, layouts, preference: accepted

    def cublasLtMatmulAlgoGetIds(self, handle, *args):
        ids, returned = args[-2], args[-1]
        ids[0], ids[1] = 66, 67
        returned._obj.value = 2
        return 0

    def cublasLtMatmulAlgoInit(self, handle, *args):
        algo_id, algo = args[-2], args[-1]
        algo._obj.data[0] = algo_id
        return 0 if algo_id == 66 else 15

    def cublasLtMatmulAlgoCapGetAttribute(self, algo, attr, buf, size, written):
        arrays = {cublaslt.CUBLASLT_ALGO_CAP_TILE_IDS: [20, 24], cublaslt.CUBLASLT_ALGO_CAP_STAGES_IDS: [16]}
        if attr in arrays:
            if size == 0:
                written._obj.value = 4 * len(arrays[attr])
            else:
                for i, v in enumerate(arrays[attr]):
                    buf[i] = v
                written._obj.value = size
            return 0
        buf._obj.value = {cublaslt.CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT: 1}.get(attr, 0)
        return 0

    def cublasLtMatmulAlgoConfigSetAttribute(self, algo, attr, buf, size):
        self.set_sizes[attr] = size
        algo._obj.data[min(attr, 7)] = buf._obj.value  # the id in 0, attributes 1-6 and 8 (as 7)
        return 0

    def cublasLtMatmulAlgoCheck(self, handle, desc, a, b, c, d, algo, result):
        tile, cluster = algo._obj.data[1], algo._obj.data[7]
        result._obj.workspaceSize = 2 << 20 if cluster == 3 else 0
        return 0 if tile == 24 else 15


def test_linear_gemm_enumerate_through_a_fake_library():
    lib = FakeLt()
    gemm = cublaslt.LinearGemm(lib, ctypes.c_void_p(), 2048, 6144, 4096)  # type: ignore[arg-type]
    found = gemm.enumerate(EnumBounds(cluster_shape_ids=(2, 3)), max_workspace_bytes=1 << 20)
    assert found.num_algo_ids == 1 and len(found.errors) == 1 and "NOT_SUPPORTED" in found.errors[0]
    assert found.num_combinations == found.num_checked == 2 * 1 * 2 * 2  # tiles, stages, clusters, swizzles
    assert found.check_statuses == {"SUCCESS": 2, "over_workspace": 2, "NOT_SUPPORTED": 4}
    assert [(r.algo.data[0], r.algo.data[1], r.algo.data[7]) for r in found.results] == [(66, 24, 2)] * 2
    assert lib.set_sizes == {1: 4, 2: 4, 3: 4, 4: 4, 5: 4, 6: 4, 8: 2}


def test_with_settings_copies_the_algorithm_and_sets_one_attribute():
    """A heuristic's algorithm with another cluster shape (lt_gemm's cluster variants): a copy, the source untouched."""
    lib = FakeLt()
    source = cublaslt.MatmulAlgo()
    source.data[0], source.data[1] = 66, 24
    variant = cublaslt.with_settings(lib, source, [(8, cublaslt_ids.CLUSTER_IDS["1x2x1"])])  # type: ignore[arg-type]
    assert (variant.data[0], variant.data[1], variant.data[7]) == (66, 24, 5)
    assert source.data[7] == 0 and lib.set_sizes == {8: 2}
