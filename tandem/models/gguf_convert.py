"""Convert a llama.cpp GGUF file into a Hugging Face-format folder (fp32 safetensors + tokenizer).

The engine only reads Hugging Face folders; converting once and caching the result (see
`loader.resolve_model`) keeps every later load a plain safetensors read.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from safetensors.torch import save_file

# Bump when the output format changes so stale cached conversions are not reused.
CONVERTER_VERSION = 1

# GGUF `general.architecture` -> (HF model_type, HF architecture class).
SUPPORTED_ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Architectures whose layers name some tensors otherwise (Gemma's norms around attention and MLP).
_ARCH_LAYER_TENSORS = {
    "gemma3": {**_LAYER_TENSORS, "ffn_norm": "pre_feedforward_layernorm",
               "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
}
# llama.cpp's convert_hf_to_gguf stores Gemma 3's RMSNorm weights w as 1 + w (its `norm_shift`,
# the (1 + w) of Gemma3RMSNorm): every `*norm.weight` tensor, undone here.
_NORM_SHIFT = {"gemma3": 1.0}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)")

# Strings whose token ids must survive the tokenizer save/reload round trip.
_TOKENIZER_PROBES = ["Hello world", "héllo wörld, 日本語 🙂", "  two spaces\n\ttab", "<|im_start|>user"]
_MISSING = object()


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors (fp32), generation_config.json and the tokenizer into out_dir."""
    reader = _open_gguf(gguf_path)
    arch = _architecture(reader, gguf_path)
    try:
        weights = _convert_tensors(reader, arch)
        config = _build_config(reader, arch, weights)
    except ValueError as e:  # missing metadata or an unknown tensor: say which file
        raise ValueError(f"{gguf_path}: {e}") from e
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if "tokenizer.ggml.tokens" in reader.fields:
        _save_tokenizer(reader, gguf_path, out_dir, config["max_position_embeddings"])


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """Map a llama.cpp tensor name (e.g. `blk.3.attn_q.weight`) to its Hugging Face name."""
    base, _, kind = gguf_name.rpartition(".")
    layer = _LAYER_NAME.fullmatch(base)
    tensors = _ARCH_LAYER_TENSORS.get(arch, _LAYER_TENSORS)
    if kind in ("weight", "bias"):
        if layer and layer[2] in tensors:
            return f"model.layers.{layer[1]}.{tensors[layer[2]]}.{kind}"
        if base in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[base]}.{kind}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf `LlamaModel.permute`) for rotate-half RoPE."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_norm_weight(arch: str, gguf_name: str, w: np.ndarray) -> np.ndarray:
    """A norm weight as Hugging Face stores it: Gemma 3's without llama.cpp's norm shift."""
    shift = _NORM_SHIFT.get(arch)
    return w - np.float32(shift) if shift and gguf_name.endswith("norm.weight") else w


def _convert_tensors(reader: GGUFReader, arch: str) -> dict[str, torch.Tensor]:
    """Dequantise every tensor to fp32 in HF layout; llama q/k are un-permuted (qwen and gemma3
    GGUFs never are), Gemma's norms un-shifted."""
    n_head = _meta(reader, f"{arch}.attention.head_count")
    n_head_kv = _meta(reader, f"{arch}.attention.head_count_kv", n_head)
    weights = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name, arch)
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:  # a quantisation type the gguf package cannot decode
            raise ValueError(f"tensor {t.name!r}: {e}") from e
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first
        if arch == "llama" and ".attn_q." in t.name:
            w = unpermute_qk(w, n_head)
        elif arch == "llama" and ".attn_k." in t.name:
            w = unpermute_qk(w, n_head_kv)
        w = hf_norm_weight(arch, t.name, w)
        weights[name] = torch.from_numpy(np.require(w, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))
    return weights


def _build_config(reader: GGUFReader, arch: str, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """HF config.json from the `<arch>.*` metadata; vocab size comes from the embedding, which is authoritative."""
    model_type, architecture = SUPPORTED_ARCHS[arch]
    hidden = _meta(reader, f"{arch}.embedding_length")
    n_head = _meta(reader, f"{arch}.attention.head_count")
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": _meta(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _meta(reader, f"{arch}.block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": _meta(reader, f"{arch}.attention.head_count_kv", n_head),
        "head_dim": _meta(reader, f"{arch}.attention.key_length", hidden // n_head),
        "max_position_embeddings": _meta(reader, f"{arch}.context_length"),
        "rms_norm_eps": _meta(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": _meta(reader, f"{arch}.rope.freq_base", 10000.0),
        "vocab_size": weights["model.embed_tokens.weight"].shape[0],
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in weights,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    for key, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        token_id = _meta(reader, f"tokenizer.ggml.{gguf_key}_token_id", None)
        if token_id is not None:
            config[f"{key}_token_id"] = token_id
    scaling = _meta(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        config["rope_scaling"] = {"rope_type": scaling, "factor": _meta(reader, f"{arch}.rope.scaling.factor")}
        original = _meta(reader, f"{arch}.rope.scaling.original_context_length", None)
        if original is not None:
            config["rope_scaling"]["original_max_position_embeddings"] = original
    if arch == "gemma3":
        config.update(_gemma3_config(reader, config))
    return config


def _gemma3_config(reader: GGUFReader, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma3TextConfig's own fields. llama.cpp fixes what the file may leave out: every 6th layer
    global, local RoPE base 10000, attention scale 1/sqrt(head_dim) (1/sqrt(hidden / heads) on
    the 62-layer 27B)."""
    layers = config["num_hidden_layers"]
    pattern = _meta(reader, "gemma3.attention.sliding_window_pattern", 6)
    sliding = list(pattern) if isinstance(pattern, list) else [bool((i + 1) % pattern) for i in range(layers)]
    big = layers == 62
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": _meta(reader, "gemma3.attention.sliding_window"),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_local_base_freq": _meta(reader, "gemma3.rope.freq_base_swa", 10000.0),
        "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"] if big else config["head_dim"],
        "final_logit_softcapping": _meta(reader, "gemma3.final_logit_softcapping", None),
        "attn_logit_softcapping": None,
    }


def _save_tokenizer(reader: GGUFReader, gguf_path: Path, out_dir: Path, context_length: int) -> None:
    """Build the fast tokenizer transformers derives from the GGUF, save it, and check the reload matches."""
    from transformers import AutoTokenizer  # slow import; only needed while converting

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.chat_template = _meta(reader, "tokenizer.chat_template", None)
    tokenizer.model_max_length = context_length
    # Keep the chat template inside tokenizer_config.json (not a side .jinja file) so any reader finds it.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    reloaded = AutoTokenizer.from_pretrained(out_dir)
    probes = list(_TOKENIZER_PROBES)
    if tokenizer.chat_template:
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        probes.append(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    for text in probes:
        if tokenizer(text).input_ids != reloaded(text).input_ids:
            raise ValueError(f"{gguf_path}: saved tokenizer does not round-trip {text!r}")


def _open_gguf(path: Path) -> GGUFReader:
    """Open a GGUF, turning the reader's low-level errors (it fails oddly on truncation) into one clear one."""
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, IndexError, ... depending on where the file ends
        raise ValueError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e


def _architecture(reader: GGUFReader, path: Path) -> str:
    """The `general.architecture` value, checked against what the converter supports."""
    arch = _meta(reader, "general.architecture", None)
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
    return arch


def _meta(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """One metadata value; float32 values are tidied (1e-05, not 9.999999747378752e-06)."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata key {key!r} is missing")
        return default
    value = field.contents()
    if field.types == [GGUFValueType.FLOAT32]:
        value = float(str(np.float32(value)))
    return value
