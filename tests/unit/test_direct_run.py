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
