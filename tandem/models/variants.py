"""The precision variants of one model that an engine serves: same architecture, other weights.

They share the activation dtype (one KV pool holds every variant's KV): the default's dtype when
it is a float precision and `dtype` is auto, else the engine's `dtype`. A variant that fails to
build is recorded with its reason; its requests go to the fallback, which must itself build.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tandem.config import EngineConfig
from tandem.models.builder import FLOAT_NAMES, build_model, resolve_precision, weight_bytes
from tandem.models.llama import AttentionFactory, LlamaForCausalLM, ModelConfig
from tandem.models.loader import gguf_source

log = logging.getLogger(__name__)


@dataclass
class ModelVariants:
    default: str
    dtype: torch.dtype
    models: dict[str, LlamaForCausalLM] = field(default_factory=dict)
    weight_bytes: dict[str, int] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)  # precision -> why it was not built


def build_variants(config: EngineConfig, model_dir: Path, cfg: ModelConfig, device: torch.device,
                   dtype: torch.dtype, attention: AttentionFactory) -> ModelVariants:
    """`dtype`: the engine's `dtype` resolved for the device (the executor's choice)."""
    default = config.quantization or FLOAT_NAMES[dtype]
    if config.dtype == "auto":
        dtype = resolve_precision(default, dtype, device)[2]
    variants = ModelVariants(default, dtype)
    for name in config.precisions(default):
        _, weights, variant_dtype = resolve_precision(name, dtype, device)
        try:
            if variant_dtype != dtype:
                raise ValueError(f"it computes in {variant_dtype} but the engine's dtype is {dtype}: "
                                 "variants share one KV pool")
            model = build_model(model_dir, cfg, weights, device, dtype, attention, gguf_source(config.model))
        except (ValueError, RuntimeError) as e:
            if config.precision_fallback in (None, name):  # nothing could serve its requests
                what = "the fallback " if name == config.precision_fallback else ""
                raise ValueError(f"{what}precision {name} cannot be built here: {e}") from e
            log.warning("precision %s cannot be built here (%s); its requests go to the fallback %s",
                        name, e, config.precision_fallback)
            variants.unavailable[name] = str(e)
            continue
        variants.models[name] = model
        variants.weight_bytes[name] = weight_bytes(model)
        log.info("weights of %s: %.1f MiB", name, variants.weight_bytes[name] / 2**20)
    return variants
