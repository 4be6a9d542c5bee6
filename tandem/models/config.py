"""The architecture fields of a Hugging Face config.json that the models read (`ModelConfig`),
checked against what they implement."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.models.layers.rope_scaling import rope_type

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3_text",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
)
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A mixture-of-experts model's sparse blocks (architectures/moe.py, layers/fused_moe.py)."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # one expert's
    renormalize: bool  # the top-k router weights divided by their sum (Qwen's norm_topk_prob)
    sparse_layers: tuple[bool, ...]  # per layer: a sparse block, else a dense MLP
    shared_expert_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert (0: none)


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
    # per layer its sliding window (None: global attention); None: no layer has one
    layer_windows: list[int | None] | None = None
    # Gemma 3 (architectures/gemma3.py reads them; the defaults are Llama's): the local layers'
    # RoPE base, the attention scale and the final logit soft cap.
    local_rope_theta: float | None = None
    attn_scale: float | None = None
    final_logit_softcapping: float | None = None
    moe: MoEConfig | None = None  # the sparse blocks of a mixture-of-experts model

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        model_type = hf.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        heads = hf["num_attention_heads"]
        rope = hf.get("rope_parameters") or {}  # transformers 5 moves theta and scaling here
        own = (
            gemma3_fields(hf)
            if model_type == "gemma3_text"
            else {"layer_windows": sliding_windows(hf, model_type)}
        )
        rope = rope.get("full_attention", rope)  # Gemma 3: one set per layer type
        scaling = hf.get("rope_scaling") or (
            rope if rope.get("rope_type", "default") != "default" else None
        )
        max_positions = hf.get("max_position_embeddings", 2048)
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
            rope_scaling=rope_scaling(scaling, hf, max_positions),
            max_position_embeddings=max_positions,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2"
            or (model_type == "qwen2_moe" and hf.get("qkv_bias", True))
            or hf.get("attention_bias", False),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            moe=moe_fields(hf) if model_type in MOE_MODEL_TYPES else None,
            **own,
        )

    @property
    def is_gemma3(self) -> bool:
        return self.model_type == "gemma3_text"

    @property
    def max_context_len(self) -> int:
        """The longest context the config allows: max_position_embeddings, or as far as YaRN or
        dynamic NTK scaling stretch the original context (original x factor)."""
        if rope_type(self.rope_scaling) not in ("yarn", "dynamic"):
            return self.max_position_embeddings
        scaling = self.rope_scaling
        stretched = int(scaling["original_max_position_embeddings"] * scaling["factor"])
        return max(self.max_position_embeddings, stretched)

    def context_len(self, max_model_len: int | None) -> int:
        """Tokens per request: `max_model_len`, or the longest the config allows; refused past
        that."""
        limit = self.max_context_len
        if max_model_len is not None and max_model_len > limit:
            why = (
                "max_position_embeddings"
                if limit == self.max_position_embeddings
                else f"{rope_type(self.rope_scaling)} RoPE scaling's original context x factor"
            )
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the {limit} positions the model's config "
                f"allows ({why})"
            )
        return max_model_len or limit


def rope_scaling(scaling: dict | None, hf: dict, max_positions: int) -> dict | None:
    """`rope_scaling` with the original context filled in, as transformers fills it: YaRN's and
    Llama 3's from a top-level `original_max_position_embeddings` or max_position_embeddings;
    dynamic NTK's is max_position_embeddings, past which it recomputes the frequencies. A type
    this implementation does not compute is refused rather than ignored."""
    kind = rope_type(scaling)
    if kind in ("yarn", "llama3"):
        original = hf.get("original_max_position_embeddings") or scaling.get(
            "original_max_position_embeddings", max_positions
        )
        scaling = {**scaling, "original_max_position_embeddings": original}
    elif kind == "dynamic":
        scaling = {**scaling, "original_max_position_embeddings": max_positions}
    return scaling


def sliding_windows(hf: dict, model_type: str) -> list[int | None] | None:
    """Per layer its sliding window, as transformers applies them: Mistral's to every layer;
    Qwen2's and Qwen3's, with use_sliding_window, to the layers `layer_types` names sliding (by
    default those from max_window_layers on). (Gemma 3's: gemma3_fields.)"""
    n, window = hf["num_hidden_layers"], hf.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window"):
        window = None
    if model_type not in ("mistral", "qwen2", "qwen3") or not window:
        return None
    if model_type == "mistral":
        return [window] * n
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention"
        for i in range(n)
    ]
    windows = [window if t == "sliding_attention" else None for t in types]
    return windows if any(windows) else None


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


def moe_fields(hf: dict) -> MoEConfig:
    """The MoEConfig of a Mixtral, Qwen2-MoE or Qwen3-MoE config dict. Mixtral: every layer
    sparse, its top-k renormalised; Qwen: `decoder_sparse_step` and `mlp_only_layers` say which
    layers are sparse (the rest dense MLPs of `intermediate_size`), `norm_topk_prob` whether to
    renormalise."""
    n, model_type = hf["num_hidden_layers"], hf["model_type"]
    window = hf.get("sliding_window")
    if hf.get("use_sliding_window") or (
        model_type == "mixtral" and window and window < hf.get("max_position_embeddings", 0)
    ):
        raise ValueError(f"{model_type} with a sliding window is not supported")
    # transformers saves Qwen3-MoE's num_experts as num_local_experts (its attribute map)
    experts = hf.get("num_experts") or hf["num_local_experts"]
    if model_type == "mixtral":
        return MoEConfig(
            experts, hf["num_experts_per_tok"], hf["intermediate_size"], True, (True,) * n
        )
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    return MoEConfig(
        experts,
        hf["num_experts_per_tok"],
        hf["moe_intermediate_size"],
        hf.get("norm_topk_prob", False),
        tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n)),
        hf["shared_expert_intermediate_size"] if model_type == "qwen2_moe" else 0,
    )
