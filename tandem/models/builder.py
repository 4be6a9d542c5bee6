"""Build one precision variant of a model: load the weights, then quantise the GEMM weights.

Storage per variant, chosen by the bytes a decode step reads against the quality it costs:
- every Linear of the decoder layers: bf16 (pre-packed for oneDNN on CPU), int8 per output
  channel, or int4 in groups of 32 (from a GGUF, the file's own Q4_0 / Q4_1 codes);
- the LM head (tied or not) is read in full at every step, so int8 and int4 variants hold an
  int8 per-channel copy of it (half the bf16 bytes; 4 bits costs it more quality than it saves);
- the embedding stays in the activation dtype: a step gathers only its tokens' rows.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from tandem.models.gemma3 import Gemma3ForCausalLM
from tandem.models.batch_invariant import make_batch_invariant
from tandem.models.gguf_quants import Int4Codes, read_int4_tensors
from tandem.models.layers import Linear, RotaryEmbedding
from tandem.models.llama import AttentionFactory, LlamaForCausalLM, ModelConfig
from tandem.models.loader import iter_weights
from tandem.models.quantization import DEFAULT_INT4_GROUP, Int4Linear, Int8Linear

log = logging.getLogger(__name__)

QUANTIZED = ("int8", "int4")
# Our fused modules and the Hugging Face tensors they hold, in row order.
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


FLOAT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def resolve_precision(precision: str | None, dtype: torch.dtype, device: torch.device) -> tuple[str, str, torch.dtype]:
    """(precision name, weight format, activation dtype). A float precision sets the dtype; fp16
    is the device's 16-bit float: the engine's dtype when that is 16-bit (bf16 on AVX-512 CPUs
    and sm80+ GPUs), else bf16 on CPU and float16 on CUDA. int8 / int4 keep `dtype`."""
    if precision is None:
        return FLOAT_NAMES[dtype], "float", dtype
    if precision in QUANTIZED:
        return precision, precision, dtype
    if precision == "fp16":
        if dtype in (torch.bfloat16, torch.float16):
            return precision, "float", dtype
        return precision, "float", torch.float16 if device.type == "cuda" else torch.bfloat16
    return precision, "float", {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]


def build_model(model_dir: Path, cfg: ModelConfig, weights: str, device: torch.device, dtype: torch.dtype,
                attention: AttentionFactory, gguf_path: Path | None = None,
                deterministic: bool = False) -> LlamaForCausalLM:
    """weights: "float" (the activation dtype) or one of QUANTIZED. deterministic: float GEMMs
    on the batch-invariant kernel (models/batch_invariant.py) instead of oneDNN's packing."""
    with torch.device(device):
        model = (Gemma3ForCausalLM if cfg.is_gemma3 else LlamaForCausalLM)(cfg, attention)
    model.load_weights(iter_weights(model_dir))
    model.to(dtype)
    for rotary in model.modules():
        if isinstance(rotary, RotaryEmbedding):  # the RoPE tables stay fp32
            rotary.cos_sin = rotary.cos_sin.float()
    model.eval()
    if weights == "float":
        if deterministic:
            make_batch_invariant(model)
        elif device.type == "cpu":
            model.pack_for_cpu()
        return model
    if weights not in QUANTIZED:
        raise ValueError(f"unknown weight format {weights!r}")
    codes = _gguf_codes(gguf_path) if weights == "int4" and gguf_path is not None else {}
    native = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, Linear) and module is not model.lm_head:
            parent, _, attr = name.rpartition(".")
            quantised, from_gguf = _quantise(name, module, weights, dtype, codes)
            native += from_gguf
            setattr(model.get_submodule(parent), attr, quantised)
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.lm_head = Int8Linear.from_float(head.data, None, dtype)
    if codes:
        log.info("int4 from %s: %d linear layers hold the file's own Q4 codes, %d were quantised from floats",
                 gguf_path.name, native, sum(isinstance(m, Int4Linear) for m in model.modules()) - native)
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights the variant holds: parameters, buffers (the rotary table excluded) and
    the kernel-packed copies that replaced plain weights."""
    tensors = list(model.parameters()) + [b for n, b in model.named_buffers() if not n.endswith("cos_sin")]
    for module in model.modules():
        tensors += [getattr(module, a, None) for a in ("packed", "codes", "packed_lm_head")]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _gguf_codes(gguf_path: Path) -> dict[str, Int4Codes]:
    codes = read_int4_tensors(gguf_path)
    if not codes:
        log.info("%s has no Q4_0 / Q4_1 tensors: int4 is quantised from the dequantised weights", gguf_path.name)
    return codes


def _quantise(name: str, module: Linear, weights: str, dtype: torch.dtype,
              codes: dict[str, Int4Codes]) -> tuple[nn.Module, bool]:
    """The quantised replacement of one Linear, and whether it took a GGUF's codes as they are."""
    bias = None if module.bias is None else module.bias.data
    if weights == "int8":
        return Int8Linear.from_float(module.weight.data, bias, dtype), False
    prefix, _, leaf = name.rpartition(".")
    parts = [f"model.{prefix}.{p}.weight" for p in _FUSED_PARTS.get(leaf, (leaf,))]
    if all(p in codes for p in parts):
        c, s, z = (torch.cat([codes[p][i] for p in parts]).to(module.weight.device) for i in range(3))
        return Int4Linear(c, s, z, bias, dtype), True
    return Int4Linear.from_float(module.weight.data, bias, dtype, DEFAULT_INT4_GROUP), False
