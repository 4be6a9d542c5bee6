"""The architecture fields of a Hugging Face config.json that the models read (`ModelConfig`),
checked against what they implement."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


@dataclass(slots=True)
class ModelConfig:
    """The fields of a Hugging Face config.json that this implementation reads."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    # Gemma 3 (architectures/gemma3.py reads them; the defaults are Llama's): per layer its sliding
    # window (None: global attention), the local layers' RoPE base, the attention scale and the
    # final logit soft cap.
    layer_windows: list[int | None] | None = None
    local_rope_theta: float | None = None
    attn_scale: float | None = None
    final_logit_softcapping: float | None = None

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        model_type = hf.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type == "mistral" and hf.get("sliding_window"):
            if hf["sliding_window"] < hf.get("max_position_embeddings", 0):
                raise ValueError(
                    "Mistral with a sliding window shorter than the context is not supported"
                )
        heads = hf["num_attention_heads"]
        rope = hf.get("rope_parameters") or {}  # transformers 5 moves theta and scaling here
        gemma = gemma3_fields(hf) if model_type == "gemma3_text" else {}
        rope = rope.get("full_attention", rope)  # Gemma 3: one set per layer type
        scaling = hf.get("rope_scaling") or (
            rope if rope.get("rope_type", "default") != "default" else None
        )
        eos = hf.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=hf.get("rope_theta") or rope.get("rope_theta", 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2" or hf.get("attention_bias", False),
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            **gemma,
        )

    @property
    def is_gemma3(self) -> bool:
        return self.model_type == "gemma3_text"

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of every layer; a row of one-byte values (int8, fp8) also holds its fp16
        scale."""
        row = self.head_dim + 2 if dtype.itemsize == 1 else self.head_dim * dtype.itemsize
        return 2 * self.num_layers * self.num_kv_heads * row


def gemma3_fields(hf: dict) -> dict:
    """ModelConfig's Gemma 3 fields from a Gemma3TextConfig dict; what this implementation does
    not compute is refused rather than ignored."""
    if hf.get("attn_logit_softcapping") is not None:
        raise ValueError("Gemma 3 with attn_logit_softcapping is not supported")
    if hf.get("use_bidirectional_attention"):
        raise ValueError(
            "Gemma 3 with bidirectional attention (an embedding model) is not supported"
        )
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(
            f"Gemma 3 with hidden_activation {hf['hidden_activation']!r} is not supported"
        )
    n = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern", 6)
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
    ]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(
            f"Gemma 3 layer_types must name sliding_attention or full_attention for each of "
            f"the {n} layers, got {types}"
        )
    local = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"Gemma 3 local RoPE type {local['rope_type']!r} is not supported")
    window = hf.get("sliding_window")
    return dict(
        layer_windows=[window if t == "sliding_attention" else None for t in types],
        local_rope_theta=local.get("rope_theta") or hf.get("rope_local_base_freq", 10000.0),
        attn_scale=hf.get("query_pre_attn_scalar", 256) ** -0.5,
        final_logit_softcapping=hf.get("final_logit_softcapping"),
    )
