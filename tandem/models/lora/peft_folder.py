"""A PEFT LoRA adapter's folder (adapter_config.json + adapter_model.safetensors, what
`save_pretrained` writes) read as an AdapterFile: its options checked, its tensors by layer and
projection."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from tandem.models.lora.adapter import MOE_REFUSAL, PARTS, AdapterFile

_KEY = re.compile(r"layers\.(\d+)\.(.+)\.lora_([AB])\.weight")
# a projection of a layer's attention or dense MLP, as a checkpoint names it
_PROJECTION = re.compile(r"(?:self_attn|mlp)\.(\w+)")
# what a layer's mixture-of-experts block names (Mixtral's block, experts, the router)
_MOE = re.compile(r"block_sparse_moe|expert|mlp\.gate$")
# PEFT options that change what the product means: refused rather than served wrong.
_UNSUPPORTED = (
    "use_dora",
    "lora_bias",
    "rank_pattern",
    "alpha_pattern",
    "modules_to_save",
    "fan_in_fan_out",
)


def read_peft_folder(folder: Path) -> AdapterFile:
    """ValueError in words: a missing file, an option or target not served."""
    where = repr(str(folder))
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    for f in (config_file, weights_file):
        if not f.is_file():
            raise ValueError(f"LoRA adapter {where} has no {f.name}")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {where} is {config['peft_type']}, not a LoRA")
    if config.get("target_parameters"):  # PEFT's way to adapt a fused experts tensor
        raise ValueError(f"LoRA adapter {where} targets parameters: {MOE_REFUSAL}")
    for key in _UNSUPPORTED:
        if config.get(key):
            raise ValueError(f"LoRA adapter {where} sets {key}, which is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {where} trains biases, which is not supported")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    targets = config.get("target_modules") or []
    if isinstance(targets, list) and (unknown := sorted(set(targets) - PARTS.keys())):
        raise ValueError(
            f"LoRA adapter {where} targets {', '.join(unknown)}; served targets: {', '.join(PARTS)}"
        )
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        m = _KEY.search(key)
        projection = None if m is None else _PROJECTION.fullmatch(m.group(2))
        if projection is None or projection.group(1) not in PARTS:
            why = MOE_REFUSAL if m and _MOE.search(m.group(2)) else "which is not served"
            raise ValueError(f"LoRA adapter {where} adapts {key!r}: {why}")
        layer, module = int(m.group(1)), projection.group(1)
        pairs.setdefault((layer, module), {})[m.group(3)] = tensor.float()
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return AdapterFile(rank, scale, pairs)
