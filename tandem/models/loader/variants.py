"""The precision variants of one model that an engine serves (same architecture, other weights),
and a speculative draft model; what each one's weights take is recorded here.

The default (`quantization: auto`) is the precision the weights are stored in (a Q4 GGUF: int4,
a Q8_0 one: int8, a bf16 folder: bf16, unless a `dtype` was asked for; fp32 weights: the
engine's float dtype). They share the activation dtype (one KV pool holds every variant's KV):
the default's dtype when it is a float precision and `dtype` is auto, else the engine's `dtype`.
A variant that fails to build is recorded with its reason; its requests go to the fallback,
which must itself build.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.config import QuantizationConfig
from tandem.models.architectures.llama import AttentionFactory, LlamaForCausalLM
from tandem.models.config import ModelConfig
from tandem.models.gguf.weights import GGUFWeights
from tandem.models.loader.builder import (
    FLOAT_NAMES,
    QUANTIZED,
    build_model,
    resolve_precision,
    stored_precision,
    weight_bytes,
)
from tandem.models.loader.folder_weights import FolderWeights
from tandem.models.loader.model_files import (
    gguf_source,
    load_config,
    load_tokenizer,
    resolve_model,
    weight_source,
)

log = logging.getLogger(__name__)


@dataclass
class ModelVariants:
    default: str
    dtype: torch.dtype
    models: dict[str, LlamaForCausalLM] = field(default_factory=dict)
    weight_bytes: dict[str, int] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)  # precision -> why it was not built


def auto_precision(
    source: GGUFWeights | FolderWeights, config_dtype: str, dtype: torch.dtype
) -> str:
    """What `quantization: auto` serves: the precision the weights are stored in; for float
    weights a dtype asked for (`config_dtype` not auto) wins, and fp32 weights take `dtype`."""
    stored = stored_precision(source)
    if stored is None or (stored not in QUANTIZED and config_dtype != "auto"):
        return FLOAT_NAMES[dtype]
    return stored


def build_variants(
    quant: QuantizationConfig,
    source: GGUFWeights | FolderWeights,
    dtype_name: str,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    attention: AttentionFactory,
    deterministic: bool = False,
) -> ModelVariants:
    """`source`: the weights every variant is read from (model_files.weight_source);
    `dtype_name`: as the engine was given it; `dtype`: that dtype resolved for the device (the
    executor's choice)."""
    default = quant.quantization
    if default in (None, "auto"):
        default = auto_precision(source, dtype_name, dtype)
    if dtype_name == "auto":
        dtype = resolve_precision(default, dtype, device)[2]
    variants = ModelVariants(default, dtype)
    for name in quant.precisions(default):
        _, weights, variant_dtype = resolve_precision(name, dtype, device)
        try:
            if variant_dtype != dtype:
                raise ValueError(
                    f"it computes in {variant_dtype} but the engine's dtype is {dtype}: "
                    "variants share one KV pool"
                )
            model = build_model(
                source, cfg, weights, device, dtype, attention, deterministic=deterministic
            )
        except (ValueError, RuntimeError) as e:
            if quant.precision_fallback in (None, name):  # nothing could serve its requests
                what = "the fallback " if name == quant.precision_fallback else ""
                raise ValueError(f"{what}precision {name} cannot be built here: {e}") from e
            log.warning(
                "precision %s cannot be built here (%s); its requests go to the fallback %s",
                name,
                e,
                quant.precision_fallback,
            )
            variants.unavailable[name] = str(e)
            continue
        variants.models[name] = model
        variants.weight_bytes[name] = weight_bytes(model)
        log.info("weights of %s: %.1f MiB", name, variants.weight_bytes[name] / 2**20)
    return variants


def build_draft(
    variants: ModelVariants,
    source: GGUFWeights | FolderWeights,
    precision: str | None,
    name: str,
    model_dir: Path,
    cfg: ModelConfig,
    device: torch.device,
    attention: AttentionFactory,
) -> LlamaForCausalLM:
    """A speculative draft. With a `precision`, a self-draft: the target's variant the engine
    already holds, or a new one built from `source` in the engine's dtype. Else the model
    `name` (an alias or a path), which must share the tokenizer. Its weight bytes join
    `variants.weight_bytes` as draft:<precision> or draft:<name>."""
    if precision is None:
        return _external_draft(variants, name, model_dir, cfg, device, attention)
    if precision in variants.models:
        log.info(
            "speculative draft self:%s: the engine's own %s variant (no extra weights)",
            precision,
            precision,
        )
        return variants.models[precision]
    _, weights, dtype = resolve_precision(precision, variants.dtype, device)
    if dtype != variants.dtype:
        raise ValueError(
            f"speculative model self:{precision} computes in {dtype} but the engine's dtype is "
            f"{variants.dtype}: a self-draft reads the target's KV, so it shares its dtype "
            f"(use self:int4 or self:int8, whose activations are the engine's)"
        )
    try:
        model = build_model(source, cfg, weights, device, dtype, attention)
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"speculative model self:{precision} cannot be built here: {e}") from e
    variants.weight_bytes[f"draft:{precision}"] = weight_bytes(model)
    log.info("weights of draft self:%s: %.1f MiB", precision, weight_bytes(model) / 2**20)
    return model


def _external_draft(
    variants: ModelVariants,
    name: str,
    model_dir: Path,
    cfg: ModelConfig,
    device: torch.device,
    attention: AttentionFactory,
) -> LlamaForCausalLM:
    """Another model as the draft, in the engine's dtype, once its vocabulary and tokenizer are
    the target's (a draft's token ids must mean the target's tokens)."""
    draft_dir = resolve_model(name)
    draft_cfg = ModelConfig.from_hf(load_config(draft_dir))
    if draft_cfg.vocab_size != cfg.vocab_size:
        raise ValueError(
            f"speculative model {name!r} has a vocabulary of {draft_cfg.vocab_size} tokens, the "
            f"target's has {cfg.vocab_size}: a draft must share the target's tokenizer"
        )
    ours, theirs = load_tokenizer(model_dir), load_tokenizer(draft_dir)
    if (ours is None) != (theirs is None) or (
        ours is not None and ours.get_vocab() != theirs.get_vocab()
    ):
        raise ValueError(
            f"speculative model {name!r} has another tokenizer than the target's: "
            "a draft must share the target's tokenizer"
        )
    model = build_model(
        weight_source(draft_dir, gguf_source(name)),
        draft_cfg,
        "float",
        device,
        variants.dtype,
        attention,
    )
    variants.weight_bytes[f"draft:{name}"] = weight_bytes(model)
    log.info(
        "weights of draft %s (%d layers): %.1f MiB",
        name,
        draft_cfg.num_layers,
        weight_bytes(model) / 2**20,
    )
    return model
