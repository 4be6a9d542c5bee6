"""transformers' model of a `--model` value on the very weights tandem reads: a GGUF's
dequantised tensors (the fp32 the decoders give, bit for bit the `gguf` package's), a folder's
safetensors as they are. The reference of the exactness tests and of
`bench offline --compare hf`."""

from __future__ import annotations

import torch

from tandem.models.loader.model_files import gguf_source, iter_weights, resolve_model


def hf_model(model: str, dtype: torch.dtype = torch.float32):
    """An eval-mode AutoModelForCausalLM; a GGUF's cache folder holds no weights, so they are
    loaded from the file into a model built from the folder's config."""
    import transformers as tf  # slow import; keep it off the module import path

    folder, gguf = resolve_model(model), gguf_source(model)
    if gguf is None:
        return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    config = tf.AutoConfig.from_pretrained(folder)
    with _no_init_weights():  # every weight is loaded next: random init was a quarter of the build
        reference = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = reference.load_state_dict(dict(iter_weights(gguf)), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(
            f"{gguf}: weights do not fit transformers' {type(reference).__name__} "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    reference.tie_weights()
    return reference.eval()


def _no_init_weights():
    """transformers' context that skips weight initialisation (its module moved in 5.0)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()
