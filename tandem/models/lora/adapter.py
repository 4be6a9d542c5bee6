"""A LoRA adapter laid out for our fused projections: q/k/v onto qkv_proj and gate/up onto
gate_up_proj, each part's B kept as its own output slice (loader.py reads and checks one), and
the projections of a base that adapters may target."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.models.config import ModelConfig

# A PEFT target module -> (our fused module, its part in the fused output's row order).
PARTS = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
MOE_REFUSAL = (
    "LoRA on a mixture-of-experts block (its experts, shared expert or router) is not served"
)


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One fused module's adapted parts: part i adds (x @ a[i*r:(i+1)*r].T) @ b[i].T to the
    output columns rows[i]:rows[i] + len(b[i]); the scaling folded into b."""

    a: torch.Tensor  # the parts' A stacked: [parts * rank, in]
    b: tuple[torch.Tensor, ...]  # each part's B: [its width, rank]
    rows: tuple[int, ...]  # where each part's slice starts in the fused output

    def tensors(self) -> list[torch.Tensor]:
        return [self.a, *self.b]

    def to(self, device: torch.device) -> LoRAWeights:
        return LoRAWeights(self.a.to(device), tuple(b.to(device) for b in self.b), self.rows)


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    rank: int
    modules: dict[str, LoRAWeights]  # "layers.3.self_attn.qkv_proj" -> its parts

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for w in self.modules.values() for t in w.tensors())

    def to(self, device: torch.device) -> LoRAAdapter:
        """On `device` (itself where it is there already: the slot views the host copy)."""
        return LoRAAdapter(self.rank, {n: w.to(device) for n, w in self.modules.items()})


@dataclass(slots=True)
class AdapterFile:
    """An adapter as read from its file, before the checks against the base: its rank, the
    scaling its products take, and (layer, PEFT module) -> {"A": [r, in], "B": [out, r]} in
    fp32, the Hugging Face layout."""

    rank: int
    scale: float
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]]


def served_modules(cfg: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Each adaptable fused module of the base ("layers.3.self_attn.qkv_proj") -> (in_features,
    its parts' output widths): every layer's attention; the MLP of a dense layer only (a sparse
    layer's MLP is a mixture of experts)."""
    q, kv, h, inter = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.hidden_size,
        cfg.intermediate_size,
    )
    attention = {"self_attn.qkv_proj": (h, [q, kv, kv]), "self_attn.o_proj": (q, [h])}
    mlp = {"mlp.gate_up_proj": (h, [inter, inter]), "mlp.down_proj": (inter, [h])}
    sparse = cfg.moe.sparse_layers if cfg.moe is not None else (False,) * cfg.num_layers
    return {
        f"layers.{i}.{name}": shape
        for i in range(cfg.num_layers)
        for name, shape in (attention if sparse[i] else {**attention, **mlp}).items()
    }
