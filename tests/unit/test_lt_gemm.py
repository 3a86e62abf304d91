"""bullet_ray.engine.lt_gemm without a GPU: the choice rule, the token lookup, the tuner over a fake cuBLASLt that
computes through host pointers (CPU tensors), and the router in a bf16 model on the CPU (outputs equal to F.linear's,
every fallback counted)."""

import contextlib
import ctypes
from pathlib import Path

import pytest
import torch

from bullet_ray.engine import lt_gemm
from bullet_ray.engine.lt_gemm import Choice, LtGemmRouter, LtGemmTuner, LtLib, Place
from bullet_ray.engine.lt_gemm import cache as lt_cache
from bullet_ray.engine.lt_gemm import router as lt_router
from bullet_ray.engine.lt_gemm import tuner as lt_tuner
from bullet_ray.engine.lt_gemm.tuner import Candidate
from bullet_ray.models.layers import linear_into


def _algo(tag: int) -> bytes:
    return bytes([tag]) + bytes(63)


def _cand(tag: int, ms: float | None, err: float = 0.0, target: int = 0) -> Candidate:
    return Candidate(_algo(tag), target, ms, err, f"algo{tag}", "heuristic")


def test_pick_keeps_the_fastest_valid_algorithm_only_past_the_margin():
    chosen = lt_tuner.pick(2048, 10.0, [_cand(1, 9.0), _cand(2, 7.0, err=0.5), _cand(3, 8.0, target=116),
                                       _cand(4, None)])
    assert (chosen.algo, chosen.sm_target, chosen.ms, chosen.label, chosen.candidates) == (_algo(3), 116, 8.0,
                                                                                          "algo3", 4)
    assert chosen.speedup == pytest.approx(1.25)
    kept_out = lt_tuner.pick(2048, 10.0, [_cand(1, 9.9)])  # 1% faster: within the timings' noise
    assert (kept_out.algo, kept_out.label, kept_out.ms) == (None, "F.linear", 10.0)
    assert lt_tuner.pick(2048, 10.0, []).algo is None


def test_tune_tokens_nearest_and_tuned_places():
    assert lt_gemm.tune_tokens(8192) == [256, 512, 1024, 2048, 4096, 8192]
    assert lt_gemm.tune_tokens(2048) == [256, 512, 1024, 2048]
    assert lt_gemm.tune_tokens(2500) == [256, 512, 1024, 2048]  # 2,500 rows take 2,048's choice
    assert lt_gemm.tune_tokens(3000)[-2:] == [2048, 3000]  # past sqrt(2) x 2,048: the cap is timed too
    assert lt_gemm.tune_tokens(200) == []
    choices = [Choice(t, None, 0, 1.0, 1.0, "F.linear") for t in (1024, 2048, 4096)]
    assert [lt_router.nearest(choices, r).tokens for r in (800, 1400, 1500, 3000, 5700)] == [1024, 1024, 2048, 4096,
                                                                                          4096]
    assert [lt_router.nearest(choices, r) for r in (256, 700, 6000, 0)] == [None] * 4  # never far from a timed count
    assert lt_router.nearest([], 2048) is None
    ladder = [116, 108, 100, 92, 84, 76, 68, 60, 52, 44, 36, 28, 20]  # an H200's prefill sides
    assert [round(lt_gemm.wave_efficiency(s, 132), 2) for s in (116, 68, 60, 44)] == [0.57, 0.97, 0.73, 1.0]
    parts = [(i, s, f"s{i}") for i, s in enumerate(ladder)] + [(13, 132, "whole"), (14, 100, None)]
    assert [p.sms for p in lt_gemm.tuned_places(parts, 132)] == [116, 108, 100, 92, 84, 76, 60, 52]


# ---- a fake cuBLASLt: LinearGemm's surface over host pointers --------------------------------------------------
class FakeStatus:
    def __init__(self, ws: int = 0):
        self.workspaceSize = ws


class FakeLt:
    """Algorithms by their first byte: 1 exact, 2 exact and fast, 3 wrong (doubles the output), 4 refuses to launch,
    5 needs too much workspace; algorithm 6 is refused by the check at odd row counts; 7 (2 with clusters of 1x2)
    is the fastest, valid only with an SM-count target."""
    cost = {1: 9.0, 2: 6.0, 3: 1.0, 4: 1.0, 5: 1.0, 6: 5.0, 7: 4.0}

    def __init__(self):
        self.last: int | None = None
        self.made: list[tuple[int, int, int, int]] = []
        self.launches: list[tuple[int, int, int]] = []  # (algo, rows, sm_target)

    def timer(self, seen: list | None = None):
        """A tuner's timing over the fake: fn runs once; F.linear (no algorithm ran) takes 10 ms, an algorithm its
        cost; `seen` collects which ran."""
        def time_ms(fn, stream):
            self.last = None
            fn()
            if seen is not None:
                seen.append(self.last)
            return 10.0 if self.last is None else self.cost[self.last]
        return time_ms

    def lib(self) -> LtLib:
        return LtLib(self.make_gemm, torch.empty(1024, dtype=torch.uint8), lambda raw: f"algo{raw[0]}",
                     self.with_cluster)

    @staticmethod
    def with_cluster(raw: bytes, cluster: str) -> bytes | None:
        if (raw[0], cluster) == (2, "1x2x1"):
            return _algo(7)
        return _algo(2) if (raw[0], cluster) == (1, "1x1x1") else None  # 1 with 1x1 clusters is 2: known already

    def make_gemm(self, m, n, k, target):
        self.made.append((m, n, k, target))
        fake = self

        class Gemm:
            def heuristics(self, ws, count):
                return [type("R", (), {"algo": bytearray(_algo(t))})() for t in (1, 2, 3, 4, 5, 6, 2)]

            def check_algo(self, algo):
                tag = bytes(algo)[0]
                if (tag == 6 and m % 2) or (tag == 7 and not target):
                    return 15, FakeStatus()
                return 0, FakeStatus(4096 if tag == 5 else 0)

            def run(self, algo, w_ptr, x_ptr, y_ptr, ws_ptr, ws_bytes, stream):
                tag = bytes(algo)[0]
                if tag == 4:
                    return 13
                fake.last = tag
                fake.launches.append((tag, m, target))
                x, w, y = (_view(p, shape) for p, shape in ((x_ptr, (m, k)), (w_ptr, (n, k)), (y_ptr, (m, n))))
                y.copy_((x.float() @ w.float().t() * (2 if tag == 3 else 1)).to(torch.bfloat16))
                return 0

            def close(self):
                pass
        return Gemm()


def _view(ptr: int, shape: tuple[int, int]) -> torch.Tensor:
    count = shape[0] * shape[1]
    buf = (ctypes.c_uint16 * count).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.bfloat16, count=count).view(shape)


@pytest.fixture
def cpu_tuning(monkeypatch):
    """The tuner's CUDA parts on the CPU: tensors on the host, no stream, the MatmulAlgo struct kept."""
    real_randn, real_empty = torch.randn, torch.empty

    def on_cpu(fn):
        return lambda *a, device=None, **kw: fn(*a, **kw)
    monkeypatch.setattr(torch, "randn", on_cpu(real_randn))
    monkeypatch.setattr(torch, "empty", on_cpu(real_empty))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(lt_tuner, "_current_stream_handle", lambda: 0)


def test_tuner_keeps_the_fastest_algorithm_that_matches_f_linear(cpu_tuning):
    fake = FakeLt()
    timer = fake.timer()
    tuner = LtGemmTuner(fake.lib(), device_sms=132, time_ms=timer, screen_ms=timer)
    places = [Place(3, 116, None), Place(0, 132, None)]
    choices = tuner.tune(places, [(32, 16), (32, 16), (16, 32)], [301, 512])
    assert set(choices) == {(0, 32, 16), (0, 16, 32)}  # both places have stream None here: one key per shape
    by_place = {(row["sms"], row["n"], row["tokens"]): row for row in tuner.log}
    assert len(tuner.log) == 2 * 2 * 2
    row = by_place[(116, 32, 512)]
    # 2 with 1x2 clusters, under the target: the fastest
    assert (row["label"], row["source"], row["sm_target"], row["ms"], row["base_ms"]) == ("algo7", "cluster_variant",
                                                                                          116, 4.0, 10.0)
    # on the whole GPU (no target: 7 refused) 3 is wrong, 4 refused, 5 over the workspace, the duplicate 2 dropped:
    # 6 (5 ms) wins at 512 rows, 2 at 301 (the check refuses 6 at odd row counts)
    assert (by_place[(132, 32, 512)]["label"], by_place[(132, 32, 512)]["source"]) == ("algo6", "heuristic")
    assert by_place[(132, 32, 301)]["label"] == "algo2"
    # a place with fewer SMs than the device asks both descriptors (no target, target 116); the whole GPU one
    assert {t for (_, _, _, t) in fake.made} == {0, 116}
    assert sum(1 for m in fake.made if m[3] == 116) == 4
    assert [row["candidates"] for row in tuner.log if row["sms"] == 132] == [4, 5, 4, 5]  # 1-4 and 6 at 512 rows


def test_router_runs_the_choice_for_its_place_and_falls_back_to_f_linear_elsewhere():
    from bullet_ray.perf.sweep import Bench

    bench = Bench("dummy:tiny-llama", "cpu", "bfloat16", use_graphs=False)
    model = bench.model
    fn = bench.step_fn(bench.batch(1, 300, 0), 0)
    plain = fn()
    attn = model.model.layers[0].self_attn
    n, k = attn.qkv_proj.weight.shape
    place = [7]
    fake = FakeLt()
    shapes = {tuple(m.weight.shape) for mods in lt_gemm.projections(model).values() for m in mods}
    choices = {(7, sn, sk): [Choice(256, _algo(2), 0, 6.0, 10.0, "algo2", "heuristic"),
                             Choice(1024, _algo(6), 116, 5.0, 10.0, "algo6", "heuristic")] for sn, sk in shapes}
    choices[(8, n, k)] = [Choice(512, None, 0, 10.0, 10.0, "F.linear")]
    router = LtGemmRouter(fake.lib(), choices, place_of=lambda: place[0], stream_of=lambda: 0)
    router.route(model)
    with pytest.raises(RuntimeError, match="routed already"):
        router.route(model)
    routed = fn()
    assert lt_gemm.rel_error(routed, plain) < 0.02  # the fake accumulates in float32 as F.linear does
    layers = len(model.model.layers)
    assert router.calls == {"routed": 4 * layers, "f_linear": 0, "check_refused": 0, "launch_failed": 0}
    assert {tag for tag, rows, _ in fake.launches} == {2} and {r for _, r, _ in fake.launches} == {300}

    x = torch.randn(1025, k, dtype=torch.bfloat16)  # nearest 1024: algorithm 6 with its target; odd rows: refused
    buf, ref = torch.zeros(1025, n, dtype=torch.bfloat16), torch.zeros(1025, n, dtype=torch.bfloat16)
    before = dict(router.calls)
    linear_into(attn.qkv_proj, x, buf)
    linear_into(attn.qkv_proj, x, buf)
    assert router.calls["check_refused"] == before["check_refused"] + 1  # checked once per row count
    assert router.calls["f_linear"] == before["f_linear"] + 2
    torch.mm(x, attn.qkv_proj.weight.t(), out=ref)
    assert torch.equal(buf, ref)
    x2 = torch.randn(1024, k, dtype=torch.bfloat16)
    out = attn.qkv_proj(x2)
    assert fake.launches[-1] == (6, 1024, 116)
    assert torch.equal(out, (x2.float() @ attn.qkv_proj.weight.float().t()).to(torch.bfloat16))
    place[0] = 8  # a place whose point kept F.linear; then one never tuned
    count = len(fake.launches)
    attn.qkv_proj(x2)
    place[0] = 99
    attn.qkv_proj(x2)
    attn.qkv_proj(x2[:, :].t().contiguous().t())  # not contiguous: F.linear
    assert len(fake.launches) == count
    report = router.report()
    assert (report["points"], report["kept"], report["by_source"]["heuristic"]) == (2 * len(shapes) + 1,
                                                                                     2 * len(shapes), 2 * len(shapes))
    router.unroute()
    assert not any("gemm_into" in m.__dict__ or "forward" in m.__dict__ for m in model.modules())
    router.close()


def test_a_refused_launch_falls_back_once_and_for_all(caplog):
    """A launch cuBLASLt refuses runs F.linear, and those rows are never launched with it again (a CUDA graph capture
    would not survive a failed launch)."""
    fake = FakeLt()
    w = torch.randn(32, 16, dtype=torch.bfloat16)
    router = LtGemmRouter(fake.lib(), {(1, 32, 16): [Choice(512, _algo(4), 0, 1.0, 2.0, "algo4", "heuristic")]},
                          place_of=lambda: 1, stream_of=lambda: 0)
    x = torch.randn(512, 16, dtype=torch.bfloat16)
    assert torch.equal(router.linear(w, x), x @ w.t())
    assert torch.equal(router.linear(w, x), x @ w.t())
    assert router.calls == {"routed": 0, "f_linear": 2, "check_refused": 0, "launch_failed": 1}
    assert "cublasLtMatmul failed" in caplog.text


def test_an_out_buffer_of_another_shape_or_dtype_runs_f_linear(monkeypatch):
    fake = FakeLt()
    w = torch.randn(32, 16, dtype=torch.bfloat16)
    router = LtGemmRouter(fake.lib(), {(1, 32, 16): [Choice(512, _algo(2), 0, 1.0, 2.0, "algo2", "heuristic")]},
                          place_of=lambda: 1, stream_of=lambda: 0)
    x = torch.randn(512, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):  # a float32 buffer: torch.mm's own error, as without the router
        router.linear(w, x, torch.zeros(512, 32))
    router.linear(w, x, torch.zeros(0, 32, dtype=torch.bfloat16))  # another shape: torch.mm's way (it resizes)
    assert (router.calls["f_linear"], len(fake.launches)) == (2, 0)
    out = torch.zeros(512, 32, dtype=torch.bfloat16)
    assert router.linear(w, x, out) is out and (router.calls["routed"], len(fake.launches)) == (1, 1)
    monkeypatch.setattr(lt_router, "MAX_DESCRIPTORS", 2)  # past it the router closes every descriptor and plans again
    for rows in (400, 450, 500):
        router.linear(w, torch.randn(rows, 16, dtype=torch.bfloat16))
    assert sorted(router._gemms) == [(450, 32, 16, 0), (500, 32, 16, 0)] and router.calls["routed"] == 4
    router.close()
    assert router._gemms == {} and router._plans == {}


def test_prefill_gemm_config_is_validated():
    from bullet_ray.config import EngineConfig
    from bullet_ray.errors import ConfigError

    with pytest.raises(ConfigError, match="prefill_gemm.*unknown GEMM 'triton'"):
        EngineConfig(prefill_gemm="triton")
    with pytest.raises(ConfigError, match="prefill_gemm.*needs a GPU"):
        EngineConfig(prefill_gemm="cublaslt")  # the CPU default
    with pytest.raises(ConfigError, match="prefill_gemm.*bfloat16"):
        EngineConfig(prefill_gemm="cublaslt", device="cuda", schedule="bullet", dtype="float16")
    assert EngineConfig(prefill_gemm="cublaslt-all", device="cuda", schedule="bullet").prefill_gemm == "cublaslt-all"
    assert EngineConfig(prefill_gemm="cublaslt", device="cuda", schedule="chunked").prefill_gemm == "cublaslt"


@pytest.mark.parametrize("changes, mode", [
    ({}, "cublas"),  # CPU
    ({"device": "cuda", "schedule": "bullet"}, "cublaslt"),
    ({"device": "cuda", "schedule": "static"}, "cublaslt"),
    ({"device": "cuda", "schedule": "chunked"}, "cublas"),  # the whole GPU: measured no gain offline
    ({"device": "cuda", "schedule": "bullet", "dtype": "float16"}, "cublas"),
    ({"device": "cuda", "schedule": "chunked", "prefill_gemm": "cublaslt"}, "cublaslt"),
    ({"device": "cuda", "schedule": "bullet", "prefill_gemm": "cublas"}, "cublas"),
])
def test_prefill_gemm_auto_tunes_cublaslt_only_on_a_gpu_bullet_or_static_prefill_worker(changes, mode):
    """The default, auto: cuBLASLt for a prefill worker on green partitions in bf16 (measured on the bullet schedule),
    cuBLAS elsewhere; an explicit choice stays as given; auto never fails validation (CPU, float16)."""
    from bullet_ray.config import EngineConfig

    cfg = EngineConfig(**changes)
    assert cfg.prefill_gemm == changes.get("prefill_gemm", "auto") and cfg.prefill_gemm_mode == mode


def test_a_worker_under_auto_keeps_cublas_when_cublaslt_cannot_open(monkeypatch, caplog):
    """The default must not fail a start that worked before it: under auto a torch whose libcublasLt cannot be
    opened leaves the projections on cuBLAS with a warning; cublaslt asked for by name fails the start."""
    from types import SimpleNamespace

    from bullet_ray.config import EngineConfig
    from bullet_ray.engine.worker.main import WorkerBase
    from bullet_ray.errors import ConfigError

    def refuse(*args, **kwargs):
        raise ConfigError("prefill_gemm", "cublaslt needs torch's libcublasLt: no such symbol")

    monkeypatch.setattr(lt_gemm, "tune_and_route", refuse)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    entry = SimpleNamespace(prefill_sms=116)
    worker = SimpleNamespace(partitioner=SimpleNamespace(ladder=[entry], side="prefill", current_index=0),
                             res=SimpleNamespace(device="cuda", model=None), role="prefill", lt_router=None,
                             graph_capture={}, _graph_partitions=lambda: [(0, None)],
                             config=EngineConfig(device="cuda", schedule="bullet"))
    WorkerBase._route_prefill_gemm(worker)
    assert worker.lt_router is None and worker.graph_capture == {}
    assert "prefill_gemm auto keeps cuBLAS: prefill_gemm: cublaslt needs torch's libcublasLt" in caplog.text
    worker.config = EngineConfig(device="cuda", schedule="bullet", prefill_gemm="cublaslt")
    with pytest.raises(ConfigError, match="libcublasLt"):
        WorkerBase._route_prefill_gemm(worker)


def test_only_the_screened_finalists_are_timed_in_full(cpu_tuning, monkeypatch):
    """The short screening ranks the candidates; only the first FINALISTS are timed as F.linear is and may be chosen
    (here the screening misranks algorithm 1 first, so with one finalist it is chosen over the faster 6)."""
    fake = FakeLt()
    full_timings: list = []
    timer = fake.timer(full_timings)

    def screen(fn, stream):
        fake.last = None
        fn()
        return 0.5 if fake.last == 1 else fake.cost[fake.last]
    monkeypatch.setattr(lt_tuner, "FINALISTS", 1)
    tuner = LtGemmTuner(fake.lib(), device_sms=132, time_ms=timer, screen_ms=screen)
    choice = tuner.tune_point(Place(0, 132, None), 512, 32, 16)
    assert full_timings == [None, 1]  # F.linear, then the one finalist
    assert (choice.label, choice.ms, choice.candidates) == ("algo1", 9.0, 5)


def test_a_cached_choice_is_not_timed_again(cpu_tuning, tmp_path, monkeypatch):
    """The tuner's cache: a second start with the same prefix times nothing and routes the same choices; another
    prefix (device, cuBLASLt, mode) times afresh; the file round-trips, and an unreadable one is an empty cache."""
    fake = FakeLt()
    timed: list = []
    timer = fake.timer(timed)
    places = [Place(3, 116, None)]
    first = LtGemmTuner(fake.lib(), device_sms=132, time_ms=timer, screen_ms=timer, cache_prefix="H200|a")
    choices = first.tune(places, [(32, 16)], [512])
    assert timed and not any(row["cached"] for row in first.log)
    monkeypatch.setenv("BULLET_RAY_LT_GEMM_CACHE", str(tmp_path / "c" / "lt.json"))
    path = lt_gemm.cache_path()
    lt_gemm.save_cache(path, first.cache)
    assert not list((tmp_path / "c").glob("*.tmp"))
    timed.clear()
    again = LtGemmTuner(fake.lib(), device_sms=132, time_ms=timer, screen_ms=timer, cache=lt_gemm.load_cache(path),
                        cache_prefix="H200|a")
    assert again.tune(places, [(32, 16)], [512]) == choices and timed == [] and again.log[0]["cached"]
    other = LtGemmTuner(fake.lib(), device_sms=132, time_ms=timer, screen_ms=timer, cache=lt_gemm.load_cache(path),
                        cache_prefix="H200|b")
    other.tune(places, [(32, 16)], [512])
    assert timed and len(other.cache) == 2
    lt_gemm.save_cache(path, {"another engine's": first.cache[next(iter(first.cache))]})
    lt_gemm.save_cache(path, other.cache)  # what the file gained meanwhile stays
    assert set(lt_gemm.load_cache(path)) == set(other.cache) | {"another engine's"}
    path.write_text("{not json")
    assert lt_gemm.load_cache(path) == {}
    monkeypatch.setenv("BULLET_RAY_LT_GEMM_CACHE", "off")
    assert lt_gemm.cache_path() is None and lt_gemm.load_cache(None) == {}
    lt_gemm.save_cache(None, {"x": {}})  # no file: nothing written, nothing raised
    monkeypatch.delenv("BULLET_RAY_LT_GEMM_CACHE")
    assert lt_gemm.cache_path() == Path.home() / ".cache" / "bullet_ray" / "lt_gemm.json"


def test_tune_and_route_leaves_nothing_routed_when_tuning_fails_and_keeps_what_was_timed(cpu_tuning, tmp_path,
                                                                                          monkeypatch):
    """A failure part-way (here the second point) unroutes the model and releases the handle, and the points timed
    before it are in the cache file for the next start; a damaged cache row is timed again; a model with nothing to
    route (not bf16) gets no router."""
    from bullet_ray.perf.sweep import Bench

    fake, closed = FakeLt(), []
    lib = fake.lib()
    lib._close = lambda: closed.append(True)
    monkeypatch.setattr(LtLib, "open", classmethod(lambda cls, *a: lib))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setenv("BULLET_RAY_LT_GEMM_CACHE", str(tmp_path / "lt.json"))
    model = Bench("dummy:tiny-llama", "cpu", "bfloat16", use_graphs=False).model
    points = []

    def tune_point(self, place, m, n, k):
        if points:
            raise RuntimeError("CUDA out of memory")
        points.append((m, n, k))
        return Choice(m, _algo(2), 0, 1.0, 2.0, "algo2", "heuristic", 3)
    monkeypatch.setattr(LtGemmTuner, "tune_point", tune_point)
    with pytest.raises(RuntimeError, match="out of memory"):
        lt_gemm.tune_and_route(model, [Place(0, 116, None)], "cublaslt", 512, "cpu", 132)
    assert not any("forward" in m.__dict__ for m in model.modules()) and closed == [True]
    saved = lt_gemm.load_cache(lt_gemm.cache_path())
    assert len(saved) == 1 and next(iter(saved)).startswith(f"v{lt_gemm.CACHE_VERSION}|fake|132 SMs|")
    key = next(iter(saved))
    lt_gemm.save_cache(lt_gemm.cache_path(), {key: {"algo": "zz"}})  # damaged: timed again
    points.clear()
    monkeypatch.setattr(LtGemmTuner, "tune_point", lambda self, place, m, n, k: points.append(m) or Choice(
        m, None, 0, 1.0, 1.0, "F.linear"))
    router, report = lt_gemm.tune_and_route(model, [Place(0, 116, None)], "cublaslt", 512, "cpu", 132)
    assert report["cached"] == 0 and len(points) == report["points"] and report["kept"] == 0
    assert report["tokens"] == [256, 512]
    router.close()
    written = lt_gemm.cache_path().stat().st_mtime_ns
    router, report = lt_gemm.tune_and_route(model, [Place(0, 116, None)], "cublaslt", 512, "cpu", 132)
    assert report["cached"] == report["points"] and lt_gemm.cache_path().stat().st_mtime_ns == written  # no rewrite
    router.close()
    router, report = lt_gemm.tune_and_route(model, [Place(0, 132, None)], "cublaslt", 512, "cpu", 132, whole=True)
    assert report["tokens"] == [16, 32, 64, 128, 256, 512]  # the whole GPU's decode batches too
    router.close()
    half = Bench("dummy:tiny-llama", "cpu", "float32", use_graphs=False).model
    assert lt_gemm.tune_and_route(half, [Place(0, 116, None)], "cublaslt", 512, "cpu", 132) is None
    assert not any("forward" in m.__dict__ for m in half.modules())


def test_a_candidate_refused_while_timed_is_not_chosen(cpu_tuning):
    """An algorithm whose first launch is right and whose later ones are refused would time as ~0 ms (nothing ran):
    the timed launch raises on a refusal, and the candidate is dropped."""
    fake = FakeLt()
    refused = {"n": 0}
    real_make = fake.make_gemm

    def make_gemm(m, n, k, target):
        gemm = real_make(m, n, k, target)
        run = gemm.run

        def flaky(algo, *args):
            if bytes(algo)[0] != 3:
                return run(algo, *args)
            if refused["n"] == 0:  # the first launch: right (as algorithm 2 computes)
                refused["n"] += 1
                return run(lt_router._algo(_algo(2)), *args)
            refused["n"] += 1
            return 13
        gemm.run = flaky
        return gemm
    lib = fake.lib()
    lib.make_gemm = make_gemm
    calls = []

    def timer(fn, stream):  # a launch that did nothing times as almost nothing, as on a GPU
        fake.last = None
        calls.append(fn)
        fn()
        if len(calls) == 1:
            return 10.0  # F.linear
        return 0.01 if fake.last is None else fake.cost[fake.last]
    choice = LtGemmTuner(lib, device_sms=132, time_ms=timer, screen_ms=timer).tune_point(Place(0, 132, None), 512,
                                                                                         32, 16)
    assert refused["n"] >= 2 and choice.label == "algo6"


def test_nothing_is_planned_inside_a_graph_capture_and_a_short_cached_algorithm_is_retimed(monkeypatch):
    """A call not planned before a capture runs F.linear without planning (no cuBLASLt set-up call while capturing)
    and is planned at its next call outside; a cache row whose algorithm is not 64 bytes is no choice."""
    fake = FakeLt()
    w = torch.randn(32, 16, dtype=torch.bfloat16)
    router = LtGemmRouter(fake.lib(), {(1, 32, 16): [Choice(512, _algo(2), 0, 1.0, 2.0, "algo2", "heuristic")]},
                          place_of=lambda: 1, stream_of=lambda: 0)
    x = torch.randn(512, 16, dtype=torch.bfloat16)
    monkeypatch.setattr(router, "_capturing", lambda: True)
    router.linear(w, x)
    assert router._plans == {} and fake.made == [] and router.calls["f_linear"] == 1
    monkeypatch.setattr(router, "_capturing", lambda: False)
    router.linear(w, x)
    assert router.calls["routed"] == 1 and len(router._plans) == 1
    row = lt_cache.choice_to_dict(Choice(512, _algo(2), 0, 1.0, 2.0, "algo2", "heuristic"))
    assert lt_cache.cached_choice(row) is not None
    assert lt_cache.cached_choice({**row, "algo": "00" * 8}) is None


def test_only_256_byte_aligned_gpu_operands_take_a_tuned_algorithm():
    """cuBLASLt's heuristic assumed 256-byte alignment: a GPU operand off it runs F.linear (host tensors only meet the
    fake library)."""
    class Gpu:
        is_cuda = True

        def __init__(self, ptr):
            self.ptr = ptr

        def data_ptr(self):
            return self.ptr
    assert lt_router._aligned(Gpu(256 * 7)) and not lt_router._aligned(Gpu(256 * 7 + 64))
    assert lt_router._aligned(torch.zeros(3)[1:])  # a host view: not the GPU's concern
