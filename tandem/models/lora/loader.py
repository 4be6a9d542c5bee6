"""Read a LoRA adapter, from a PEFT folder (peft_folder.py) or a llama.cpp GGUF LoRA file
(gguf_lora.py), check it against the base model and lay it out (adapter.py). Everything is checked
before anything is kept, so a bad adapter is refused in words and nothing of it is half-loaded."""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.models.config import ModelConfig
from tandem.models.lora.adapter import (
    MOE_REFUSAL,
    PARTS,
    AdapterFile,
    LoRAAdapter,
    LoRAWeights,
    served_modules,
)
from tandem.models.lora.gguf_lora import read_gguf_lora
from tandem.models.lora.peft_folder import read_peft_folder


def load_adapter(
    path: str | Path, cfg: ModelConfig, max_rank: int, dtype: torch.dtype = torch.float32
) -> LoRAAdapter:
    """The adapter at `path` (a PEFT folder, or a .gguf LoRA file) for a base of `cfg`, on the
    host in `dtype`; ValueError saying what is wrong (a missing file, another base's shapes, a
    rank over `max_rank`, an unsupported option or target)."""
    where = repr(str(path))
    gguf = str(path).lower().endswith(".gguf")
    read = read_gguf_lora(Path(path), cfg) if gguf else read_peft_folder(Path(path))
    if read.rank > max_rank:
        raise ValueError(
            f"LoRA adapter {where} has rank {read.rank}, over max_lora_rank {max_rank}"
        )
    _check(read, cfg, where)
    return LoRAAdapter(read.rank, _fuse(read, cfg, dtype))


def _check(read: AdapterFile, cfg: ModelConfig, where: str) -> None:
    """Each pair whole, on a layer and projection the base serves, of the base's shapes."""
    if not read.pairs:
        raise ValueError(f"LoRA adapter {where} holds no LoRA weights")
    served = served_modules(cfg)
    for (layer, module), pair in sorted(read.pairs.items()):
        name = f"layers.{layer}.{module}"
        if len(pair) != 2:
            raise ValueError(f"LoRA adapter {where} lacks lora_A or lora_B of {name}")
        if layer >= cfg.num_layers:
            raise ValueError(
                f"LoRA adapter {where} adapts layer {layer}; the base has {cfg.num_layers}"
            )
        fused, part = PARTS[module]
        if f"layers.{layer}.{fused}" not in served:
            raise ValueError(f"LoRA adapter {where} adapts {name}: {MOE_REFUSAL}")
        in_features, widths = served[f"layers.{layer}.{fused}"]
        for which, want in (("A", (read.rank, in_features)), ("B", (widths[part], read.rank))):
            if tuple(pair[which].shape) != want:
                raise ValueError(
                    f"LoRA adapter {where}: lora_{which} of {name} has shape "
                    f"{tuple(pair[which].shape)}, this base needs {want}: an adapter of another "
                    "base model (or rank)"
                )


def _fuse(read: AdapterFile, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, LoRAWeights]:
    """Each fused module's adapted parts: A stacked, B per output slice (scaled in fp32, then
    cast)."""
    served = served_modules(cfg)
    grouped: dict[str, list[tuple[int, dict[str, torch.Tensor]]]] = {}
    for (layer, module), pair in sorted(read.pairs.items()):
        fused, part = PARTS[module]
        grouped.setdefault(f"layers.{layer}.{fused}", []).append((part, pair))
    modules = {}
    for name, parts in grouped.items():
        parts.sort(key=lambda p: p[0])
        widths = served[name][1]
        modules[name] = LoRAWeights(
            torch.cat([pair["A"] for _, pair in parts]).to(dtype),
            tuple((pair["B"] * read.scale).to(dtype).contiguous() for _, pair in parts),
            tuple(sum(widths[:part]) for part, _ in parts),
        )
    return modules
