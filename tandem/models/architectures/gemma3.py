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

import functools
from collections.abc import Callable, Iterable

import torch
from torch import nn

from tandem.models.architectures.llama import AttentionFactory, DecoderLayer, LlamaForCausalLM
from tandem.models.config import ModelConfig
from tandem.models.layers.activation import Gate
from tandem.models.layers.decoder_ops import NormWeights
from tandem.models.layers.layernorm import RMSNorm
from tandem.models.layers.rotary_embedding import RotaryEmbedding


def scaled_embedding(
    embed_tokens: nn.Module, hidden_size: int, input_ids: torch.Tensor
) -> torch.Tensor:
    """Gemma's input: the embedding times sqrt(hidden), the scale rounded to the embedding's
    dtype first, as transformers rounds it."""
    x = embed_tokens(input_ids)
    return x * torch.tensor(hidden_size**0.5).to(x.dtype)


class Gemma3DecoderLayer(DecoderLayer):
    """The Llama layer gated by gelu-tanh, its RoPE table and window by its kind, with norms on
    the attention's and the MLP's outputs; its `post_attention_layernorm` is Gemma's (after the
    attention), `pre_feedforward_layernorm` the MLP's input norm."""

    gate: Gate = Gate.GELU_TANH

    def __init__(
        self, cfg: ModelConfig, attention: AttentionFactory, sliding_window: int | None
    ) -> None:
        super().__init__(cfg, attention, sliding_window)
        self.rope = 0 if sliding_window is None else 1  # local layers: rotary_local
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def norm_weights(self) -> NormWeights:
        return NormWeights(
            self.input_layernorm.weight,
            self.pre_feedforward_layernorm.weight,
            self.post_attention_layernorm.weight,
            self.post_feedforward_layernorm.weight,
        )


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, attention: AttentionFactory) -> None:
        super().__init__(cfg, attention)
        # `rotary` (global layers) is the Llama one: rope_theta and rope_scaling.
        self.rotary_local = RotaryEmbedding(
            cfg.head_dim, cfg.max_context_len, cfg.local_rope_theta, None
        )

    @staticmethod
    def decoder_layer(cfg: ModelConfig, attention: AttentionFactory, index: int) -> DecoderLayer:
        return Gemma3DecoderLayer(cfg, attention, cfg.layer_windows[index])

    def embedding(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return functools.partial(scaled_embedding, self.embed_tokens, self.cfg.hidden_size)

    def rotaries(self) -> list[RotaryEmbedding]:
        return [self.rotary, self.rotary_local]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face-named Gemma 3 weights; every RMSNorm weight w is held as 1 + w."""
        super().load_weights(
            (name, tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)
            for name, tensor in weights
        )
