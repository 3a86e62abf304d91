"""DirectRun: after the first layer of a plan, attention calls the wrapper's compiled module directly with the
recorded arguments; every layer's result equals the public run's, a new plan is recorded again, and a wrapper
whose run does more than one module call keeps the public run."""

from __future__ import annotations

import torch

from bullet_ray.engine.attention.direct_run import DirectRun


class _Module:
    """A compiled module's entry point: out = (q + k.sum() - v.sum()) * scale, scale fixed by the plan."""

    def __init__(self) -> None:
        self.calls = 0

    def paged_run(self, workspace, scale, q, k, v, out, flag):
        self.calls += 1
        assert workspace == "ws" and flag is True
        out.copy_((q + k.sum() - v.sum()) * scale)


class _Wrapper:
    def __init__(self, module_calls_per_run: int = 1) -> None:
        self._cached_module = None
        self.scale = 0.0
        self.public_runs = 0
        self.module_calls_per_run = module_calls_per_run

    def plan(self, scale: float) -> None:
        self._cached_module = self._cached_module or _Module()
        self.scale = scale

    def run(self, q, kv, out=None, enable_pdl=None):
        self.public_runs += 1
        k, v = kv
        for _ in range(self.module_calls_per_run):
            self._cached_module.paged_run("ws", self.scale, q, k, v, out, True)
        return out


def _layers(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((2,), float(i)), torch.full((2,), 0.5 * i)) for i in range(n)]


def _expected(q, k, v, scale):
    return (q + k.sum() - v.sum()) * scale


def test_layers_after_the_first_call_the_module_directly():
    wrapper, plans = _Wrapper(), [0]

    def plan(scale):
        plans[0] += 1
        wrapper.plan(scale)

    direct = DirectRun(wrapper, lambda: plans[0])
    for step, scale in enumerate((2.0, 3.0)):
        plan(scale)
        for i, (k, v) in enumerate(_layers()):
            q, out = torch.arange(3.0) + step + i, torch.empty(3)
            got = direct.run(q, k, v, out)
            assert got is out
            torch.testing.assert_close(out, _expected(q, k, v, scale))
    assert wrapper.public_runs == 2  # the first layer of each plan
    assert direct.direct_calls == 6 and wrapper._cached_module.calls == 8


def test_a_run_that_calls_the_module_twice_keeps_the_public_run():
    wrapper = _Wrapper(module_calls_per_run=2)
    wrapper.plan(1.0)
    direct = DirectRun(wrapper, lambda: 1)
    for k, v in _layers():
        q, out = torch.ones(3), torch.empty(3)
        direct.run(q, k, v, out)
        torch.testing.assert_close(out, _expected(q, k, v, 1.0))
    assert not direct.usable and direct.direct_calls == 0 and wrapper.public_runs == 4


def test_an_unplanned_wrapper_takes_the_public_run():
    class _Unplanned(_Wrapper):
        def run(self, q, kv, out=None, enable_pdl=None):
            self.public_runs += 1
            out.copy_(q)
            return out

    wrapper = _Unplanned()
    direct = DirectRun(wrapper, lambda: 0)
    q, out = torch.ones(3), torch.empty(3)
    direct.run(q, *_layers(1)[0], out)
    assert direct.usable and wrapper.public_runs == 1 and torch.equal(out, q)


def test_the_record_keeps_no_layer_tensors_alive():
    import gc
    import weakref

    wrapper = _Wrapper()
    wrapper.plan(1.0)
    direct = DirectRun(wrapper, lambda: 1)
    refs = []
    for k, v in _layers(3):
        q, out = torch.ones(3), torch.empty(3)
        direct.run(q, k, v, out)
        refs.append((weakref.ref(q), weakref.ref(out)))
        del q, out
    gc.collect()
    assert direct.direct_calls == 2
    assert all(rq() is None and ro() is None for rq, ro in refs)


def test_keyword_calls_and_a_new_output_keep_the_public_run():
    class _Keywords(_Wrapper):
        def run(self, q, kv, out=None, enable_pdl=None):
            self.public_runs += 1
            self._cached_module.paged_run("ws", self.scale, q, kv[0], kv[1], out=out, flag=True)
            return out

    class _Copies(_Wrapper):
        def run(self, q, kv, out=None, enable_pdl=None):
            self.public_runs += 1
            fresh = torch.empty_like(out)
            self._cached_module.paged_run("ws", self.scale, q, kv[0], kv[1], fresh, True)
            out.copy_(fresh)
            return fresh

    for cls in (_Keywords, _Copies):
        wrapper = cls()
        wrapper.plan(2.0)
        direct = DirectRun(wrapper, lambda: 1)
        for k, v in _layers(3):
            q, out = torch.ones(3), torch.empty(3)
            got = direct.run(q, k, v, out)
            torch.testing.assert_close(got, _expected(q, k, v, 2.0))
        assert not direct.usable and direct.direct_calls == 0 and wrapper.public_runs == 3


def test_the_backend_keeps_one_direct_run_per_wrapper_and_reads_its_plan_count():
    from bullet_ray.engine.attention.flashinfer_backend import FlashInferBackend

    class _Fence:
        def __init__(self):
            self.counts = {}

        def plan_count(self, wrapper):
            return self.counts.get(id(wrapper), 0)

    backend = object.__new__(FlashInferBackend)  # no flashinfer needed for the bookkeeping
    backend._direct, backend.fence = {}, _Fence()
    a, b = _Wrapper(), _Wrapper()
    assert backend._run(a) is backend._run(a) and backend._run(a) is not backend._run(b)
    backend.fence.counts[id(a)] = 5
    assert backend._run(a)._plan_count() == 5 and backend._run(b)._plan_count() == 0


class _RaggedWrapper(_Wrapper):
    """flashinfer's ragged wrapper takes K and V themselves: run(q, k, v, out=...)."""

    def run(self, q, k, v, out=None, enable_pdl=None):
        self.public_runs += 1
        self._cached_module.paged_run("ws", self.scale, q, k, v, out, True)
        return out


def test_a_ragged_wrapper_is_called_with_k_and_v_and_then_directly():
    wrapper = _RaggedWrapper()
    wrapper.plan(2.0)
    direct = DirectRun(wrapper, lambda: 1, ragged=True)
    for i, (k, v) in enumerate(_layers()):
        q, out = torch.arange(3.0) + i, torch.empty(3)
        direct.run(q, k, v, out)
        torch.testing.assert_close(out, _expected(q, k, v, 2.0))
    assert direct.usable and wrapper.public_runs == 1 and direct.direct_calls == 3
