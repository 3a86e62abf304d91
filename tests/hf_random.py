"""Random-weight transformers models for tests that compare our decoder (and loaders) against transformers."""

from __future__ import annotations

import torch


def random_hf_model(config: dict, seed: int = 0):
    """A transformers model of `config` (an HF config dict) with random weights, incl. non-trivial norms
    and biases; initializer_range 0.1 spreads the logits, so greedy decoding meets fewer near-ties."""
    import transformers

    cfg = transformers.AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items()
                                                                       if k != "model_type"})
    cfg.initializer_range = 0.1
    torch.manual_seed(seed)
    model = getattr(transformers, config["architectures"][0])(cfg).float().eval()
    perturb_norms_and_biases(model)
    return model


def perturb_norms_and_biases(model: torch.nn.Module) -> None:
    """Norm weights near 1 and small biases, random (from torch's current seed): a missed residual, norm or
    bias then shows in the outputs."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
