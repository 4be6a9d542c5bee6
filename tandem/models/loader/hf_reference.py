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
    # from_pretrained, not load_state_dict: it turns checkpoint names into the model's (one
    # expert's tensors into transformers' stacked experts)
    reference, info = getattr(tf, config.architectures[0]).from_pretrained(
        None,
        config=config,
        state_dict=dict(iter_weights(gguf)),
        dtype=dtype,
        output_loading_info=True,
    )
    missing, unexpected = info["missing_keys"], info["unexpected_keys"]
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(
            f"{gguf}: weights do not fit transformers' {type(reference).__name__} "
            f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})"
        )
    return reference.eval()
