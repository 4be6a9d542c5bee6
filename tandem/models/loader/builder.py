"""Build one precision variant of a model: read each weight from the file into its serving form.

Storage per variant, chosen by the bytes a decode step reads against the quality it costs:
- every Linear of the decoder layers: bf16 (pre-packed for oneDNN on CPU), int8 per output
  channel, or int4 in groups of 32: from a GGUF, the file's own Q4_0 / Q4_1 / Q4_K codes and
  its Q5_0 / Q5_1 / Q5_K 5-bit codes as they are (a fused layer's int4 part holds one width: 5
  bits where a part has them), every other type quantised from that one tensor's dequantised
  floats (approximate, as any requantisation). Where the CPU's integer kernel runs, Q6_K and
  Q8_0 tensors are served as their own blocks (Q6KLinear; Int8Linear with a d per 32) in the
  int8 variant and in int4 of a file stored mostly in 4- and 5-bit blocks (a Q4_K_M, whose
  Q6_K / Q8_0 v_proj and down_proj, requantised to 5 bits, cost Gemma 3 270M 3.7% perplexity);
  elsewhere they are int8 per channel. A fused layer whose parts differ (Q4_K q and k, Q6_K v)
  keeps each part in its format and runs them in one integer-kernel call (RowParts). In other
  files (int4 of a Q8_0 or float file) every tensor without 4- or 5-bit codes is requantised
  to 4 bits;
- the LM head (tied or not) is read in full at every step, so int8 and int4 variants hold an
  int8 per-channel copy of it (half the bf16 bytes; 4 bits costs it more quality than it saves),
  except that a GGUF vocabulary stored in Q6_K or Q8_0 keeps its blocks, and int4 keeps one
  stored in 4- or 5-bit blocks as its codes (nothing requantised);
- the embedding and norms stay in the activation dtype: a step gathers only its tokens' rows;
- an MoE block's experts are linears like any other (a GGUF's 3-D expert tensors are read expert
  by expert, each in its stored format); its routers stay in the activation dtype.

A quantised Linear is built straight from its file tensors, so no float copy of the decoder
layers is ever held; the float modules it replaces are never written (their untouched pages
cost no memory).
"""

from __future__ import annotations

import itertools
import logging

import torch
from gguf import GGMLQuantizationType as Q
from torch import nn

from tandem.models.architectures.gemma3 import Gemma3ForCausalLM
from tandem.models.architectures.llama import FUSED_PARTS, AttentionFactory, LlamaForCausalLM
from tandem.models.architectures.moe import MoEForCausalLM
from tandem.models.config import ModelConfig
from tandem.models.decode_plan import DecodePlan
from tandem.models.gguf.weights import GGUFWeights
from tandem.models.layers.batch_invariant import make_batch_invariant
from tandem.models.layers.fused_moe import FusedMoE
from tandem.models.layers.linear import Linear
from tandem.models.layers.rotary_embedding import RotaryEmbedding
from tandem.models.loader.folder_weights import FolderWeights
from tandem.models.loader.model_files import load_config
from tandem.models.loader.stored_layers import LayerFormat, served_as, stored_layer
from tandem.models.quantization import base
from tandem.models.quantization.embedding import QuantEmbedding
from tandem.models.quantization.host_memory import (
    gather_on_huge_pages,
    move_to_huge_pages,
    trim_heap,
)
from tandem.models.quantization.int4 import Int4Linear
from tandem.models.quantization.int8 import Int8Linear
from tandem.models.quantization.q6k import Q6KLinear
from tandem.models.quantization.row_parts import RowParts

log = logging.getLogger(__name__)

QUANTIZED = ("int8", "int4")
# GGUF types by the precision that serves them without losing what they store: 4- and 5-bit
# blocks int4 (their own codes), 6- and 8-bit int8.
_STORED_AS = {
    Q.Q4_0: "int4",
    Q.Q4_1: "int4",
    Q.Q4_K: "int4",
    Q.Q5_0: "int4",
    Q.Q5_1: "int4",
    Q.Q5_K: "int4",
    Q.Q6_K: "int8",
    Q.Q8_0: "int8",
    Q.F16: "fp16",
    Q.BF16: "bf16",
}
_FOLDER_DTYPES = {"bfloat16": "bf16", "float16": "fp16"}


FLOAT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def resolve_precision(
    precision: str | None, dtype: torch.dtype, device: torch.device
) -> tuple[str, str, torch.dtype]:
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


def stored_precision(source: GGUFWeights | FolderWeights) -> str | None:
    """The precision the weights are stored in (what `quantization: auto` serves): a GGUF's by
    the type holding most of its decoder-layer weights (`_STORED_AS`; a tie goes to the wider
    type, which loses nothing), a folder's by its config's dtype; None for fp32 weights (the
    engine's float dtype serves them)."""
    if isinstance(source, FolderWeights):
        hf_config = load_config(source.path)
        return _FOLDER_DTYPES.get(hf_config.get("dtype") or hf_config.get("torch_dtype"))
    return _gguf_stored(source)


def _gguf_stored(weights: GGUFWeights) -> str | None:
    sizes: dict[str | None, int] = {}
    for name, t in weights.tensors.items():
        if name.startswith("model.layers.") and len(t.shape) == 2:
            kind = _STORED_AS.get(t.kind)
            sizes[kind] = sizes.get(kind, 0) + t.shape[0] * t.shape[1]
    wider = ["int4", "int8", "fp16", "bf16", None]
    return max(sizes, key=lambda kind: (sizes[kind], wider.index(kind))) if sizes else None


def build_model(
    source: GGUFWeights | FolderWeights,
    cfg: ModelConfig,
    weights: str,
    device: torch.device,
    dtype: torch.dtype,
    attention: AttentionFactory,
    deterministic: bool = False,
) -> LlamaForCausalLM:
    """weights: "float" (the activation dtype) or one of QUANTIZED, read from `source` (a GGUF,
    or a folder's safetensors: `weight_source`, opened once per load and shared by its variants).
    deterministic: float GEMMs on the batch-invariant kernel (layers/batch_invariant.py) instead
    of oneDNN's packing."""
    if weights != "float" and weights not in QUANTIZED:
        raise ValueError(f"unknown weight format {weights!r}")
    with torch.device(device):
        model = model_class(cfg)(cfg, attention)
    _retype(model, dtype)
    model.eval()
    consumed: set[str] = set()
    # On CPU each quantised table is on huge pages (quantization/host_memory.py) as soon as it is
    # built: made there, or moved (loading then holds one table twice at most).
    if weights in QUANTIZED:
        native = 0
        # int4 of a file mostly in 4-5 bit blocks keeps its wider tensors wide (see the docstring)
        keep_wide = (
            weights == "int4" and isinstance(source, GGUFWeights) and _gguf_stored(source) == "int4"
        )
        for name, module in list(model.named_modules()):
            parent, _, attr = name.rpartition(".")
            if isinstance(module, Linear) and not _kept_float(model, module, parent, attr):
                quantised, parts, from_file = _quantise(
                    name, module, weights, dtype, source, keep_wide
                )
                native += from_file
                consumed.update(parts)
                setattr(model.get_submodule(parent), attr, quantised)
                trim_heap()
                move_to_huge_pages(_tensors(quantised))
        for block in model.modules():
            if isinstance(block, FusedMoE):  # its experts' tables are each under a huge page
                gather_on_huge_pages(_tensors(block))
        if native:
            log.info(
                "%s from %s: %d of the linear layers' tensors are served as the file stores them",
                weights,
                source.path,
                native,
            )
        consumed |= _quantise_vocab(model, source, weights, dtype)
        move_to_huge_pages(_tensors(model.lm_head, model.embed_tokens))
    model.load_weights((name, source.get(name)) for name in source.names() if name not in consumed)
    if weights == "float":
        if deterministic:
            make_batch_invariant(model)
        elif device.type == "cpu":
            model.pack_for_cpu()
        return model
    trim_heap()
    model.decode_plan = DecodePlan.build(model)
    return model


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    if cfg.is_gemma3:
        return Gemma3ForCausalLM
    return LlamaForCausalLM if cfg.moe is None else MoEForCausalLM


def _kept_float(model: LlamaForCausalLM, module: Linear, parent: str, attr: str) -> bool:
    """The linears a quantised variant keeps in float: an MoE block's routers (the LM head is
    quantised on its own, `_quantise_vocab`)."""
    if module is model.lm_head:
        return True
    return attr in FusedMoE.ROUTERS and isinstance(model.get_submodule(parent), FusedMoE)


def _tensors(*modules: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers of `modules`."""
    return [t for m in modules for t in (*m.parameters(), *m.buffers())]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights the variant holds: parameters, buffers (the rotary table excluded) and
    the kernel-packed copies that replaced plain weights."""
    tensors = list(model.parameters()) + [
        b for n, b in model.named_buffers() if not n.endswith("cos_sin")
    ]
    for module in model.modules():
        tensors += [getattr(module, a, None) for a in ("packed", "codes", "packed_lm_head")]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _retype(model: nn.Module, dtype: torch.dtype) -> None:
    """The parameters in `dtype`, left unwritten (every one is loaded, or replaced by a
    quantised module): `model.to(dtype)` would write, so hold, a whole float model. The RoPE
    tables stay fp32, rounded through `dtype` as `model.to(dtype)` then `.float()` rounds them."""
    for param in model.parameters():
        if param.dtype != dtype:
            param.data = torch.empty(param.shape, dtype=dtype, device=param.device)
    for rotary in model.modules():
        if isinstance(rotary, RotaryEmbedding):
            rotary.round_through(dtype)


def _quantise_vocab(
    model: LlamaForCausalLM, source: GGUFWeights | FolderWeights, weights: str, dtype: torch.dtype
) -> set[str]:
    """The LM head as a quantised table, and the embedding read from it (tied) or from its own
    table (`_vocab_table`); returns the file tensors taken."""
    device = model.embed_tokens.weight.device
    embed = "model.embed_tokens.weight"
    head = embed if model.lm_head is None else "lm_head.weight"
    model.lm_head = _vocab_table(source, head, weights, dtype, device)
    table = model.lm_head if head == embed else _vocab_table(source, embed, weights, dtype, device)
    model.embed_tokens = QuantEmbedding(table, dtype)
    return {embed, head}


def _vocab_table(
    source: GGUFWeights | FolderWeights,
    name: str,
    weights: str,
    dtype: torch.dtype,
    device: torch.device,
) -> Int4Linear | Int8Linear | Q6KLinear:
    """One vocabulary table: the file's own Q6_K or Q8_0 blocks, or its 4- / 5-bit codes in an
    int4 variant, on the integer kernel (nothing requantised; 4-6 bit codes are also fewer bytes
    a step than int8), else int8 per channel."""
    fmt = served_as(source, name, weights, dtype, device)
    if fmt == LayerFormat.INT4 and not base.int8_act_kernel(device, dtype, *source.shape(name)):
        fmt = LayerFormat.INT8  # an embedding reads its rows from the integer kernel's tiles only
    return stored_layer(fmt, source, [name], None, dtype, device)[0]


def _quantise(
    name: str,
    module: Linear,
    weights: str,
    dtype: torch.dtype,
    source: GGUFWeights | FolderWeights,
    keep_wide: bool,
) -> tuple[nn.Module, list[str], int]:
    """The quantised replacement of one Linear, the file tensors it took, and how many of them
    it took as the file's own codes. In the int8 variant, and in int4 of a file stored mostly in
    4-5 bits (keep_wide), each part is served as it is stored where a kernel reads that
    (`served_as`: Q6_K and Q8_0 blocks, 4- and 5-bit codes in int4, the rest int8); a fused layer
    whose parts differ runs as consecutive parts of one format (RowParts). Otherwise int4
    throughout, every part without 4- or 5-bit codes requantised."""
    prefix, _, leaf = name.rpartition(".")
    parts = [f"model.{prefix}.{p}.weight" for p in FUSED_PARTS.get(leaf, (leaf,))]
    device = module.weight.device
    bias = None
    if module.bias is not None:
        bias = torch.cat([source.get(p.removesuffix(".weight") + ".bias") for p in parts]).to(
            device
        )
    names = parts + (
        [p.removesuffix(".weight") + ".bias" for p in parts] if bias is not None else []
    )
    if not (weights == "int8" or keep_wide):
        layer, native = stored_layer(LayerFormat.INT4, source, parts, bias, dtype, device)
        return layer, names, native
    formats = [served_as(source, p, weights, dtype, device) for p in parts]
    layers, native, at = [], 0, 0
    for fmt, group in itertools.groupby(zip(formats, parts), key=lambda pair: pair[0]):
        group = [p for _, p in group]
        rows = sum(source.shape(p)[0] for p in group)
        layer, from_file = stored_layer(
            fmt, source, group, None if bias is None else bias[at : at + rows], dtype, device
        )
        layers.append(layer)
        native += from_file
        at += rows
    return (layers[0] if len(layers) == 1 else RowParts(layers)), names, native
