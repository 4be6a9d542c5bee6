"""Named model shapes (from each model's Hugging Face config.json), so the analyzer, the
planner and the cost model can size KV and compute for a model they do not load."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_params: int  # every parameter, embeddings and all experts included
    # Mixture of experts: routed experts per layer, experts each token chooses, and one expert's
    # SwiGLU width (gate, up and down: 3 * hidden * moe_intermediate_size parameters).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    @property
    def expert_params(self) -> int:
        """Parameters of every routed expert of every layer (0 for a dense model)."""
        return (
            3 * self.num_layers * self.num_experts * self.hidden_size * self.moe_intermediate_size
        )

    @property
    def active_params(self) -> int:
        """Parameters one token computes with: all but the experts it does not route to."""
        unused = self.num_experts - self.num_experts_per_tok
        return self.num_params - self.expert_params * unused // max(self.num_experts, 1)


MODEL_SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 8_030_261_248),
        ModelShape("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256, 70_553_706_496),
        ModelShape("qwen2-7b", 28, 3584, 28, 4, 128, 18944, 152064, 7_615_616_512),
        ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, 134_515_008),
        # Qwen/Qwen3-30B-A3B's config.json: every layer routes (mlp_only_layers is empty, so
        # its intermediate_size, 6144, has no weights); embeddings untied. 30.5B parameters,
        # 3.35B active per token (its model card: 30.5B, 3.3B activated).
        ModelShape(
            "qwen3-30b-a3b", 48, 2048, 32, 4, 128, 6144, 151936, 30_532_122_624, 128, 8, 768
        ),
    )
}


def get_shape(name: str) -> ModelShape:
    try:
        return MODEL_SHAPES[name]
    except KeyError:
        raise ValueError(
            f"unknown model shape {name!r}; known: {', '.join(MODEL_SHAPES)}"
        ) from None


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int = 2) -> int:
    """K and V of every layer for one token: 2 * layers * kv_heads * head_dim * dtype_bytes."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes
