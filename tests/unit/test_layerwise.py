"""Layer-wise prefill: the model's piecewise forward (embed -> layer groups -> final norm) equals the whole
forward, the group bounds cover every layer, and the hook between groups runs once per boundary."""

from __future__ import annotations

import json
from importlib.resources import files

import pytest
import torch

from bullet_ray.config import EngineConfig
from bullet_ray.engine.layerwise import LayerGroups, forward_in_groups, group_bounds
from bullet_ray.errors import ConfigError
from bullet_ray.models.config import ModelConfig
from bullet_ray.models.llama import LlamaForCausalLM
from bullet_ray.models.testing import PagedRunner

PROMPTS = [[1, 17, 300, 42, 9, 255, 77, 5, 88, 130, 64], [1, 400, 23], list(range(40, 60))]


def _model(num_layers: int = 4) -> LlamaForCausalLM:
    d = json.loads((files("bullet_ray.models") / "presets" / "tiny-llama.json").read_text())
    d["num_hidden_layers"] = num_layers
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_hf_dict(d))
    with torch.no_grad():  # non-trivial norms, so a missed residual or norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model


class _Grouped(torch.nn.Module):
    """Calls like the model, but runs it in layer groups (what ModelRunner does for a long prefill)."""

    def __init__(self, model: LlamaForCausalLM, num_groups: int, calls: list[int]) -> None:
        super().__init__()
        self.inner, self.config, self.num_groups, self.calls = model, model.config, num_groups, calls

    def forward(self, ids, positions, ctx):
        return forward_in_groups(self.inner, ids, positions, ctx, self.num_groups, lambda: self.calls.append(1))

    def compute_logits(self, hidden, upcast=True):
        return self.inner.compute_logits(hidden, upcast)


def test_group_bounds_cover_every_layer_in_order():
    assert group_bounds(4, 1) == [(0, 4)]
    assert group_bounds(4, 2) == [(0, 2), (2, 4)]
    assert group_bounds(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert group_bounds(2, 8) == [(0, 1), (1, 2)]  # never an empty group
    with pytest.raises(ValueError):
        group_bounds(4, 0)


@pytest.mark.parametrize("num_groups", [2, 3, 4])
def test_piecewise_forward_equals_whole_forward(num_groups):
    model = _model(4)
    whole = PagedRunner(model, len(PROMPTS), 64, seed=1)
    calls: list[int] = []
    grouped = PagedRunner(_Grouped(model, num_groups, calls), len(PROMPTS), 64, seed=1)
    # a prefill, then a second chunk of the same prompts over the cached KV, then one decode step
    for step in (PROMPTS, [p[:5] for p in PROMPTS], [[7], [8], [9]]):
        torch.testing.assert_close(grouped.step(step), whole.step(step), rtol=1e-5, atol=1e-5)
    assert len(calls) == 3 * (num_groups - 1)  # the hook runs at every boundary, never before or after


def test_forward_layers_checks_its_range():
    model = _model(2)
    with pytest.raises(ValueError, match="layer range"):
        model.forward_layers(torch.zeros(1, model.config.hidden_size), None, torch.zeros(1, dtype=torch.long),
                             None, 1, 3)  # type: ignore[arg-type]


def test_layer_groups_apply_to_long_batches_only():
    groups = LayerGroups(num_groups=2, min_tokens=16)
    assert groups.applies(16) and not groups.applies(15)
    assert not LayerGroups(num_groups=1, min_tokens=1).applies(10_000)


@pytest.mark.parametrize("field,value", [("prefill_layer_groups", 0), ("prefill_layer_groups", 10_000),
                                         ("prefill_layer_group_min_tokens", 0)])
def test_config_bounds_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**{field: value})
