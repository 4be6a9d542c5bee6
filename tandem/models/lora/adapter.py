"""A PEFT LoRA adapter read from its folder (adapter_config.json + adapter_model.safetensors) and
checked against the base model, laid out for our fused projections: q/k/v onto qkv_proj and
gate/up onto gate_up_proj. Everything is checked before anything is kept, so a bad adapter is
refused in words and nothing of it is half-loaded."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

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
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# PEFT options that change what the product means: refused rather than served wrong.
_UNSUPPORTED = (
    "use_dora",
    "lora_bias",
    "rank_pattern",
    "alpha_pattern",
    "modules_to_save",
    "fan_in_fan_out",
)


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One fused module's low-rank pair: delta = (x @ a.T) @ b.T. a stacks the parts' A
    [sum of ranks, in]; b is block-diagonal [out, sum of ranks] (a part not adapted has none),
    the scaling folded in."""

    a: torch.Tensor
    b: torch.Tensor

    def to(self, device: torch.device, dtype: torch.dtype) -> LoRAWeights:
        return LoRAWeights(self.a.to(device, dtype), self.b.to(device, dtype))


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    rank: int
    modules: dict[str, LoRAWeights]  # "layers.3.self_attn.qkv_proj" -> its pair

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for w in self.modules.values() for t in (w.a, w.b))


def part_shapes(cfg: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Our fused module -> (in_features, its parts' output widths)."""
    q, kv, h, inter = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.hidden_size,
        cfg.intermediate_size,
    )
    return {
        "self_attn.qkv_proj": (h, [q, kv, kv]),
        "self_attn.o_proj": (q, [h]),
        "mlp.gate_up_proj": (h, [inter, inter]),
        "mlp.down_proj": (inter, [h]),
    }


def load_adapter(path: str | Path, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """The adapter at `path` for a base of `cfg`, in fp32 on the host; ValueError saying what is
    wrong (a missing file, another base's shapes, a rank over `max_rank`, an unsupported option
    or target)."""
    folder = Path(path)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for f in (config_file, weights_file):
        if not f.is_file():
            raise ValueError(f"LoRA adapter {str(folder)!r} has no {f.name}")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {str(folder)!r} is {config['peft_type']}, not a LoRA")
    for key in _UNSUPPORTED:
        if config.get(key):
            raise ValueError(f"LoRA adapter {str(folder)!r} sets {key}, which is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {str(folder)!r} trains biases, which is not supported")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    if rank > max_rank:
        raise ValueError(
            f"LoRA adapter {str(folder)!r} has rank {rank}, over max_lora_rank {max_rank}"
        )
    targets = config.get("target_modules") or []
    if isinstance(targets, list) and (unknown := sorted(set(targets) - PARTS.keys())):
        raise ValueError(
            f"LoRA adapter {str(folder)!r} targets {', '.join(unknown)}; served targets: "
            f"{', '.join(PARTS)}"
        )
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    pairs = _pairs(load_file(str(weights_file)), folder, cfg, rank)
    return LoRAAdapter(rank, _fuse(pairs, cfg, rank, scale))


def _pairs(
    tensors: dict[str, torch.Tensor], folder: Path, cfg: ModelConfig, rank: int
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, PEFT module) -> {"A": [r, in], "B": [out, r]}, each checked against the base."""
    shapes = part_shapes(cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in PARTS:
            raise ValueError(f"LoRA adapter {str(folder)!r} adapts {key!r}, which is not served")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if layer >= cfg.num_layers:
            raise ValueError(
                f"LoRA adapter {str(folder)!r} adapts layer {layer}; the base has {cfg.num_layers}"
            )
        fused, part = PARTS[module]
        in_features, widths = shapes[fused]
        want = (rank, in_features) if which == "A" else (widths[part], rank)
        if tuple(tensor.shape) != want:
            raise ValueError(
                f"LoRA adapter {str(folder)!r}: {key} has shape {tuple(tensor.shape)}, this base "
                f"needs {want}: an adapter of another base model (or rank)"
            )
        pairs.setdefault((layer, module), {})[which] = tensor.float()
    if not pairs:
        raise ValueError(f"LoRA adapter {str(folder)!r} holds no LoRA weights")
    halves = [f"layers.{k[0]}.{k[1]}" for k, v in pairs.items() if len(v) != 2]
    if halves:
        raise ValueError(f"LoRA adapter {str(folder)!r} lacks lora_A or lora_B of {halves[0]}")
    return pairs


def _fuse(
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]],
    cfg: ModelConfig,
    rank: int,
    scale: float,
) -> dict[str, LoRAWeights]:
    """Each fused module's A stacked and B block-diagonal over its adapted parts."""
    shapes = part_shapes(cfg)
    grouped: dict[str, list[tuple[int, dict[str, torch.Tensor]]]] = {}
    for (layer, module), pair in sorted(pairs.items()):
        fused, part = PARTS[module]
        grouped.setdefault(f"layers.{layer}.{fused}", []).append((part, pair))
    modules = {}
    for name, parts in grouped.items():
        widths = shapes[name.split(".", 2)[2]][1]
        offsets = [sum(widths[:i]) for i in range(len(widths))]
        b = torch.zeros(sum(widths), rank * len(parts))
        for col, (part, pair) in enumerate(sorted(parts, key=lambda p: p[0])):
            rows = slice(offsets[part], offsets[part] + widths[part])
            b[rows, col * rank : (col + 1) * rank] = pair["B"] * scale
        a = torch.cat([pair["A"] for _, pair in sorted(parts, key=lambda p: p[0])])
        modules[name] = LoRAWeights(a.contiguous(), b)
    return modules
