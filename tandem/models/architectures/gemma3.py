"""Gemma 3 text models: the Llama family's projections, paged attention and weight loading, with
Gemma's differences on top: interleaved sliding-window (local) and global attention layers, each
with its own RoPE base; QK-norm; a gelu-tanh gated MLP; norms before and after both the attention
and the MLP; the embedding scaled by sqrt(hidden); an attention scale from query_pre_attn_scalar;
an optional final logit soft cap.

Gemma's RMSNorm scales by (1 + w); the weights are stored here with the 1 added at load time (in
fp32, as transformers adds it), so the Llama RMSNorm and its fused native kernels serve them. A
bf16 variant holds 1 + w rounded to bf16 (transformers multiplies by it in fp32): bf16 is not
bit-exact with transformers anyway; fp32 is."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tandem.models.layers.activation import Gate
from tandem.models.layers.layernorm import RMSNorm
from tandem.models.layers.rotary_embedding import RotaryEmbedding, StepRope
from tandem.models.architectures.llama import (
    MLP, Attention, AttentionFactory, LlamaForCausalLM, per_layer,
)
from tandem.models.config import ModelConfig


def scaled_embedding(embed_tokens: nn.Module, hidden_size: int, input_ids: torch.Tensor) -> torch.Tensor:
    """Gemma's input: the embedding times sqrt(hidden), the scale rounded to the embedding's
    dtype first, as transformers rounds it."""
    x = embed_tokens(input_ids)
    return x * torch.tensor(hidden_size ** 0.5).to(x.dtype)


class Gemma3MLP(MLP):
    """The Llama MLP's fused [gate | up] projection, gated by gelu-tanh instead of silu."""
    gate: Gate = Gate.GELU_TANH


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: AttentionFactory, sliding_window: int | None) -> None:
        super().__init__()
        self.sliding = sliding_window is not None
        self.self_attn = Attention(cfg, attention, sliding_window)
        self.mlp = Gemma3MLP(cfg)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def forward(self, x, residual: torch.Tensor | None, rope: StepRope, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's normed MLP output, the residual stream before it), as the Llama layer
        passes them: each residual add is fused into the norm that follows it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add_forward(x, residual)
        attn = self.post_attention_layernorm(self.self_attn.forward(h, rope, kv_cache, meta))
        residual, h = self.pre_feedforward_layernorm.add_forward(attn, residual)
        return self.post_feedforward_layernorm(self.mlp.forward(h)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, attention: AttentionFactory) -> None:
        super().__init__(cfg, attention)
        # `rotary` (global layers) is the Llama one: rope_theta and rope_scaling.
        self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope_theta, None)

    @staticmethod
    def decoder_layer(cfg: ModelConfig, attention: AttentionFactory, index: int) -> nn.Module:
        return Gemma3DecoderLayer(cfg, attention, cfg.layer_windows[index])

    def forward_modules(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        kv_caches: list[torch.Tensor], meta: Any) -> torch.Tensor:
        x = scaled_embedding(self.embed_tokens, self.cfg.hidden_size, input_ids)
        ropes = {False: self.rotary(positions, x.dtype), True: self.rotary_local(positions, x.dtype)}
        residual = None
        for layer, kv_cache, layer_meta in zip(self.layers, kv_caches, per_layer(meta)):
            x, residual = layer.forward(x, residual, ropes[layer.sliding], kv_cache, layer_meta)
        return residual + x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face-named Gemma 3 weights; every RMSNorm weight w is held as 1 + w."""
        super().load_weights((name, tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)
                             for name, tensor in weights)
