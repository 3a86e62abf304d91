"""The dense decoder of the Llama family (Llama 2/3/3.1, SmolLM2, Mistral), Qwen2/2.5 (q/k/v bias) and
Qwen3 (q/k RMSNorm): one implementation, switched by ModelConfig flags.

q/k/v and gate/up projections are fused (`qkv_proj`, `gate_up_proj`); `load_weights` maps Hugging Face
names onto the fused parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from bullet_ray.engine.attention.base import AttentionContext
from bullet_ray.models.config import ModelConfig
from bullet_ray.models.layers import RMSNorm, RotaryEmbedding, linear_into, silu_and_mul


def _linear(n_in: int, n_out: int, bias: bool, dtype: torch.dtype, device: str | torch.device) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=bias, dtype=dtype, device=device)
    layer.weight.requires_grad_(False)
    if layer.bias is not None:
        layer.bias.requires_grad_(False)
    return layer


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: str | torch.device) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_size, self.kv_size = c.q_size, c.kv_size
        self.qkv_proj = _linear(c.hidden_size, c.q_size + 2 * c.kv_size, c.attention_bias, dtype, device)
        self.o_proj = _linear(c.q_size, c.hidden_size, c.o_proj_bias, dtype, device)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype, device)
        self.qk_norm = c.qk_norm

    def project(self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim], k and v [T, kv_heads, head_dim], rotated: views of one fused qkv row.
        With `out` ([T, q_size + 2 kv_size], a CUDA graph's static buffer) the results are views of it."""
        if out is None:
            qkv = self.qkv_proj(x)
        else:  # straight into the buffer (the GEMM F.linear runs, or the one the projection is routed to)
            qkv = linear_into(self.qkv_proj, x, out)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        rq, rk = (self.q_norm(q), self.k_norm(k)) if self.qk_norm else (q, k)
        rq, rk = rotary(positions, rq, rk)  # in place on CUDA (fused kernel)
        if out is None:
            return rq, rk, v
        store_into(q, rq)
        store_into(k, rk)
        return q, k, v

    def output(self, attn_out: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attn_out.reshape(-1, self.q_size))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding,
                ctx: AttentionContext) -> torch.Tensor:
        q, k, v = self.project(positions, x, rotary)
        return self.output(ctx.backend.forward(self.layer_idx, q, k, v, ctx.metadata))  # backends take strides


def store_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Make dst hold src (nothing to do when an in-place kernel already wrote dst)."""
    if src.data_ptr() != dst.data_ptr() or src.stride() != dst.stride():
        dst.copy_(src)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> None:
        super().__init__()
        self.gate_up_proj = _linear(config.hidden_size, 2 * config.intermediate_size, False, dtype, device)
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: str | torch.device) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, dtype, device)
        self.mlp = MLP(config, dtype, device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                rotary: RotaryEmbedding, ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the caller adds the two (the next
        layer's input norm does, fused). residual None: h is the embedding, the stream's start."""
        q, k, v, residual = self.attention_inputs(positions, h, residual, rotary)
        return self.attention_outputs(ctx.backend.forward(self.self_attn.layer_idx, q, k, v, ctx.metadata), residual)

    # the layer around its attention (bullet_ray.engine.piecewise_graphs captures these parts) -----------
    def attention_inputs(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                         rotary: RotaryEmbedding, out: torch.Tensor | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The input norm (with the residual add) and the rotated q, k, v; also the residual stream."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm.add_forward(h, residual)
        q, k, v = self.self_attn.project(positions, h, rotary, out)
        return q, k, v, residual

    def attention_outputs(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj, the post-attention norm (with the residual add) and the MLP."""
        h, residual = self.post_attention_layernorm.add_forward(self.self_attn.output(attn_out), residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, device) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class LlamaForCausalLM(nn.Module):
    """Also serves Mistral, SmolLM2, Qwen2/2.5 and Qwen3 (see module docstring)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, dtype, device)
        rotary_device = "cpu" if str(device) == "meta" else device
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, rotary_device)
        if not config.tie_word_embeddings:
            self.lm_head = _linear(config.hidden_size, config.vocab_size, False, dtype, device)

    def output_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """The whole forward: embed, every layer in one piece, the final norm (hidden states, not logits)."""
        h, residual = self.forward_layers(self.embed(input_ids), None, positions, ctx, 0, self.num_layers)
        return self.final_norm(h, residual)

    # piecewise forward (layer-wise prefill: bullet_ray.engine.layerwise) ---------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The hidden states entering layer 0."""
        return self.model.embed_tokens(input_ids)

    def forward_layers(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                       ctx: AttentionContext, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layers [start, end): takes and returns (hidden, residual) as carried between pieces; residual is
        None only before layer 0. The pieces of a forward must cover [0, num_layers) in order."""
        if not 0 <= start <= end <= self.num_layers:
            raise ValueError(f"layer range [{start}, {end}) outside [0, {self.num_layers})")
        for layer in self.model.layers[start:end]:
            hidden, residual = layer(positions, hidden, residual, self.rotary, ctx)
        return hidden, residual

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The last layer's output and residual summed and normed: the hidden states logits are taken from."""
        return self.model.norm(hidden) if residual is None else self.model.norm.add_forward(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """The LM head's logits, float32 unless `upcast` is False (the runner's: the sampler upcasts only where
        it must, and a greedy batch's argmax needs no float32 copy of [rows, vocab])."""
        logits = torch.nn.functional.linear(hidden, self.output_weight())
        return logits.float() if upcast else logits

    # weight loading ---------------------------------------------------------------------------------
    def expected_weights(self) -> set[str]:
        """What `load_weights` reports once every parameter (and every shard of a fused one) is filled."""
        c = self.config
        expected: set[str] = set()
        for name, _ in self.named_parameters():
            if ".qkv_proj." in name:
                expected |= {f"{name}:0", f"{name}:{c.q_size}", f"{name}:{c.q_size + c.kv_size}"}
            elif ".gate_up_proj." in name:
                expected |= {f"{name}:0", f"{name}:{c.intermediate_size}"}
            else:
                expected.add(name)
        return expected

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into the (fused) parameters; returns the names loaded
        (`name` or `name:first_row` for a shard of a fused parameter; compare with `expected_weights`)."""
        c = self.config
        params = dict(self.named_parameters())
        qkv_offsets = {"q_proj": (0, c.q_size), "k_proj": (c.q_size, c.kv_size),
                       "v_proj": (c.q_size + c.kv_size, c.kv_size)}
        gate_up_offsets = {"gate_proj": (0, c.intermediate_size), "up_proj": (c.intermediate_size, c.intermediate_size)}
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and c.tie_word_embeddings:
                continue
            target, rows = name, None
            for part, offsets, fused in ((".self_attn.", qkv_offsets, "qkv_proj"), (".mlp.", gate_up_offsets, "gate_up_proj")):
                if part not in name:
                    continue
                for shard, (start, size) in offsets.items():
                    if f"{part}{shard}." in name:
                        target, rows = name.replace(f"{part}{shard}.", f"{part}{fused}."), (start, size)
            if target not in params:
                if "rotary_emb" in name:
                    continue
                raise KeyError(f"unexpected weight {name!r} for {c.architecture}")
            param = params[target]
            with torch.no_grad():
                dest = param.data if rows is None else param.data.narrow(0, rows[0], rows[1])
                if dest.shape != tensor.shape:
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
                dest.copy_(tensor)
            loaded.add(target if rows is None else f"{target}:{rows[0]}")
        return loaded
