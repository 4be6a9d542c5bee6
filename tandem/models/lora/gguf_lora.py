"""A llama.cpp GGUF LoRA file (what convert_lora_to_gguf.py writes) read as an AdapterFile.

Its header says general.type "adapter", adapter.type "lora", adapter.lora.alpha and the base's
general.architecture. Each adapted base tensor (`blk.3.attn_q.weight`) has `.lora_a`, GGUF dims
[in, rank] (PEFT's A [rank, in]), and `.lora_b`, dims [rank, out] (B [out, rank]), in F32, F16,
BF16 or Q8_0. llama.cpp scales each product by alpha / rank, the rank lora_b's first dim (no
alpha: 1). Its converter permutes llama's q/k rows as it does the base's: B's rows here, undone
the same way."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from tandem.models.config import ModelConfig
from tandem.models.gguf.file import GGUFFile
from tandem.models.gguf.model_folder import SUPPORTED_ARCHS
from tandem.models.gguf.quants import dequantize_rows
from tandem.models.gguf.weights import unpermute_qk
from tandem.models.lora.adapter import MOE_REFUSAL, AdapterFile

_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")
_MODULES = {
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}
# a sparse layer's experts, shared expert and routers
_MOE = re.compile(r"ffn_\w+_(?:exps|shexp)|ffn_gate_inp\w*")
# GGUF architectures whose base model types other than the arch's own (llama.cpp writes Mistral
# and Mixtral as llama)
_ALSO = {"llama": ("mistral", "mixtral")}


def read_gguf_lora(path: Path, cfg: ModelConfig) -> AdapterFile:
    """ValueError in words: not a GGUF LoRA, another architecture's, a tensor not served."""
    where = repr(str(path))
    if not path.is_file():
        raise ValueError(f"LoRA adapter {where} is not a file")
    file = GGUFFile(path)
    meta = file.metadata
    kinds = meta.get("general.type"), meta.get("adapter.type")
    if kinds != ("adapter", "lora"):
        raise ValueError(
            f"{where} is not a GGUF LoRA adapter (general.type {kinds[0]!r}, adapter.type "
            f"{kinds[1]!r})"
        )
    arch = meta.get("general.architecture")
    if cfg.model_type not in (SUPPORTED_ARCHS.get(arch, ("",))[0], *_ALSO.get(arch, ())):
        raise ValueError(f"LoRA adapter {where} is for a {arch} model, not {cfg.model_type}")
    heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads} if arch == "llama" else {}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    ranks = set()
    for t in file.tensors:
        m = _TENSOR.fullmatch(t.name)
        if m is None or m.group(2) not in _MODULES:
            why = MOE_REFUSAL if _MOE.search(t.name) else "which is not served"
            raise ValueError(f"LoRA adapter {where} adapts {t.name!r}: {why}")
        layer, module, which = int(m.group(1)), _MODULES[m.group(2)], m.group(3).upper()
        w = dequantize_rows(file.read_rows(t, 0, t.rows), t.kind).reshape(t.dims[::-1])
        if which == "B":
            ranks.add(t.dims[0])
            if module in heads:
                w = unpermute_qk(w, heads[module])
        pairs.setdefault((layer, module), {})[which] = torch.from_numpy(np.ascontiguousarray(w))
    if len(ranks) > 1:
        raise ValueError(f"LoRA adapter {where} mixes ranks {sorted(ranks)}: one rank is served")
    rank = ranks.pop() if ranks else 0
    alpha = float(meta.get("adapter.lora.alpha") or 0.0)
    return AdapterFile(rank, alpha / rank if alpha else 1.0, pairs)
