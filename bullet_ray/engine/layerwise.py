"""Layer-wise prefill: one long prefill batch runs through the model in groups of layers, so the SM split
can move between groups instead of waiting for the whole step (BulletServe's --num-prefill-layers).

The batch's inputs and attention metadata (the flashinfer plan included) are built once and serve every
group; between groups the host waits for the groups launched so far (their SMs are free then), calls the
worker's hook (which may follow a new split and returns the stream the next group launches on) and goes
on. The whole forward is the same code in one piece (`LlamaForCausalLM.forward`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bullet_ray.engine.attention.base import AttentionContext

logger = logging.getLogger(__name__)

# called between two groups; returns the CUDA stream the next group launches on (None: the current one)
BetweenGroups = Callable[[], Any]


@dataclass(frozen=True)
class LayerGroups:
    """When and how a prefill batch is split into layer groups."""

    num_groups: int  # groups per forward (1: whole forward)
    min_tokens: int  # a batch with fewer new tokens runs whole

    def applies(self, num_tokens: int) -> bool:
        return self.num_groups > 1 and num_tokens >= self.min_tokens


def group_bounds(num_layers: int, num_groups: int) -> list[tuple[int, int]]:
    """[start, end) of each group: contiguous, covering every layer, sizes differing by at most one (the
    first groups take the extra layers); never more groups than layers."""
    if num_layers < 1 or num_groups < 1:
        raise ValueError(f"need >= 1 layer and >= 1 group, got {num_layers} layers, {num_groups} groups")
    n = min(num_groups, num_layers)
    size, extra = divmod(num_layers, n)
    bounds, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def forward_in_groups(model: Any, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                      num_groups: int, between_groups: BetweenGroups | None) -> torch.Tensor:
    """The model's forward (final hidden states) run group by group over one attention context; between
    groups the launched work is waited for and `between_groups` runs (a stream it returns becomes current
    for the rest of the step, ordered after the work so far)."""
    bounds = group_bounds(model.num_layers, num_groups)
    hidden, residual = model.embed(input_ids), None
    for i, (start, end) in enumerate(bounds):
        if i > 0:
            _switch_point(input_ids.device, between_groups)
        hidden, residual = model.forward_layers(hidden, residual, positions, ctx, start, end)
    return model.final_norm(hidden, residual)


def _switch_point(device: torch.device, between_groups: BetweenGroups | None) -> None:
    """The step boundary inside a forward: the groups so far have finished when the hook runs."""
    current = torch.cuda.current_stream(device) if device.type == "cuda" else None
    if current is not None:
        current.synchronize()  # the split may move now: this side's SMs must be free of our work
    stream = between_groups() if between_groups is not None else None
    if stream is not None and current is not None and stream != current:
        # tensors of the earlier groups (inputs, plan, hidden) live in the old stream's pool: that stream
        # runs again only after a later switch back, which waits for this step's done event (WorkerBase.launch)
        stream.wait_stream(current)
        torch.cuda.set_stream(stream)  # the rest of the step (groups, sampling, done event) runs there
