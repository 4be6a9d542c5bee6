"""The model section: what is served (weights, tokenizer, chat template) and in which dtype."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tandem.config.option import option

FLOAT_DTYPES = ("auto", "float32", "bfloat16", "float16")  # `dtype` and `kv_cache_dtype` values


def cache_root() -> Path:
    """Where converted GGUFs live: $TANDEM_CACHE_DIR, else ~/.cache/tandem/models (compiled
    kernels go beside it)."""
    default = Path.home() / ".cache" / "tandem" / "models"
    return Path(os.environ.get("TANDEM_CACHE_DIR") or default)


@dataclass(slots=True)
class ModelConfig:
    model: str = option("smollm2-135m", "model alias, HF folder or GGUF file")
    tokenizer: str | None = option(
        None,
        "tokenizer other than the model's: a folder with tokenizer files, a tokenizer.json, or "
        "a model (alias, .gguf, HF folder); refused if it has more tokens than the model's "
        "embedding rows",
        none="the model's own",
    )
    chat_template: str | None = option(
        None,
        "chat template in place of the tokenizer's: a Jinja file, or the template itself (a "
        "value holding {, } or a newline); refused if Jinja cannot parse it",
        none="the tokenizer's own",
    )
    dtype: str = option(
        "auto",
        "the activations' dtype (auto: bf16 on AVX-512 CPUs and CUDA, else fp32)",
        choices=FLOAT_DTYPES,
    )
    max_model_len: int | None = option(
        None,
        "tokens per request, prompt and output",
        unit="tokens",
        none="the model's context, capped by the KV pool",
    )
    seed: int = option(0, "seed of sampled requests without their own")

    def __post_init__(self) -> None:
        if self.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
