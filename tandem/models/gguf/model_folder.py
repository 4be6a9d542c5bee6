"""The Hugging Face folder a llama.cpp GGUF file describes, without its weights: config.json,
generation_config.json and the tokenizer files, written once into the cache
(`loader/model_files.resolve_model`).

The weights stay in the GGUF and are read from it tensor by tensor (`gguf/weights.py`), so the
cache holds kilobytes of metadata beside the tokenizer, never a float copy of the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.models.gguf.file import GGUFFile
from tandem.models.tokenizer_record import write_record

# Bump when the folder's contents change so stale cached folders are not reused.
FOLDER_VERSION = 5
# the class AutoTokenizer picks for the folder (models/tokenizer_record.py)
TOKENIZER_CLASS_FILE = "tokenizer_class.json"

# GGUF `general.architecture` -> (HF model_type, HF architecture class).
SUPPORTED_ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}

# Strings whose token ids must survive the tokenizer save/reload round trip.
_TOKENIZER_PROBES = [
    "Hello world",
    "héllo wörld, 日本語 🙂",
    "  two spaces\n\ttab",
    "<|im_start|>user",
]
_MISSING = object()


def write_model_folder(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, generation_config.json and the tokenizer of a GGUF into out_dir."""
    reader = GGUFFile(gguf_path)  # the header only: a ValueError names a corrupt or truncated file
    arch = architecture(reader, gguf_path)
    try:
        config = _build_config(reader, arch)
    except ValueError as e:  # missing metadata: say which file
        raise ValueError(f"{gguf_path}: {e}") from e
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if "tokenizer.ggml.tokens" in reader.metadata:
        _save_tokenizer(
            reader, gguf_path, out_dir, config["model_type"], config["max_position_embeddings"]
        )


def _build_config(reader: GGUFFile, arch: str) -> dict[str, Any]:
    """HF config.json from the `<arch>.*` metadata; vocab size comes from the embedding, which is
    authoritative."""
    shapes = {t.name: list(t.dims) for t in reader.tensors}
    if "token_embd.weight" not in shapes:
        raise ValueError("no token_embd.weight tensor")
    model_type, hf_class = SUPPORTED_ARCHS[arch]
    hidden = metadata(reader, f"{arch}.embedding_length")
    n_head = metadata(reader, f"{arch}.attention.head_count")
    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": metadata(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": metadata(reader, f"{arch}.block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": metadata(reader, f"{arch}.attention.head_count_kv", n_head),
        "head_dim": metadata(reader, f"{arch}.attention.key_length", hidden // n_head),
        "max_position_embeddings": metadata(reader, f"{arch}.context_length"),
        "rms_norm_eps": metadata(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": metadata(reader, f"{arch}.rope.freq_base", 10000.0),
        "vocab_size": shapes["token_embd.weight"][-1],
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    for key, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        token_id = metadata(reader, f"tokenizer.ggml.{gguf_key}_token_id", None)
        if token_id is not None:
            config[f"{key}_token_id"] = token_id
    scaling = _rope_scaling(reader, arch)
    if scaling is not None:
        config["rope_scaling"] = scaling
    if arch == "gemma3":
        config.update(_gemma3_config(reader, config))
    if arch in ("qwen2moe", "qwen3moe") or metadata(reader, f"{arch}.expert_count", 0):
        config.update(_moe_config(reader, arch, config, shapes))
    return config


# llama.cpp's YaRN keys (as convert_hf_to_gguf writes them) -> transformers' rope_scaling keys
_YARN_KEYS = {
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
    "yarn_attn_factor": "attention_factor",
}


def _rope_scaling(reader: GGUFFile, arch: str) -> dict[str, Any] | None:
    """transformers' rope_scaling from `{arch}.rope.scaling.*`, or None (no scaling). YaRN's
    extrapolation factor has no transformers counterpart: any but 1 is refused."""
    kind = metadata(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    scaling = {"rope_type": kind, "factor": metadata(reader, f"{arch}.rope.scaling.factor")}
    original = metadata(reader, f"{arch}.rope.scaling.original_context_length", None)
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    if kind == "yarn":
        for key, name in _YARN_KEYS.items():
            value = metadata(reader, f"{arch}.rope.scaling.{key}", None)
            if value is not None:
                scaling[name] = value
        if metadata(reader, f"{arch}.rope.scaling.yarn_ext_factor", 1.0) != 1.0:
            raise ValueError("YaRN with an extrapolation factor other than 1 is not supported")
    return scaling


def _moe_config(
    reader: GGUFFile, arch: str, config: dict[str, Any], shapes: dict[str, list[int]]
) -> dict[str, Any]:
    """A mixture-of-experts config's own fields: Mixtral's for a `llama` file with experts. As
    llama.cpp: Qwen3-MoE renormalises its top-k, Qwen2-MoE does not (unless the file says), and a
    layer without a router is dense."""
    experts = metadata(reader, f"{arch}.expert_count")
    used = metadata(reader, f"{arch}.expert_used_count")
    if arch == "llama":
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": experts,
            "num_experts_per_tok": used,
            "sliding_window": None,
        }
    layers = config["num_hidden_layers"]
    moe = {
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": metadata(reader, f"{arch}.expert_feed_forward_length"),
        "norm_topk_prob": metadata(reader, f"{arch}.expert_weights_norm", arch == "qwen3moe"),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [
            i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in shapes
        ],
        "use_sliding_window": False,
    }
    if arch == "qwen2moe":
        moe["shared_expert_intermediate_size"] = metadata(
            reader, f"{arch}.expert_shared_feed_forward_length"
        )
        moe["qkv_bias"] = config["attention_bias"]
    return moe


def _gemma3_config(reader: GGUFFile, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma3TextConfig's own fields. llama.cpp fixes what the file may leave out: every 6th layer
    global, local RoPE base 10000, attention scale 1/sqrt(head_dim) (1/sqrt(hidden / heads) on
    the 62-layer 27B)."""
    layers = config["num_hidden_layers"]
    pattern = metadata(reader, "gemma3.attention.sliding_window_pattern", 6)
    sliding = (
        list(pattern)
        if isinstance(pattern, list)
        else [bool((i + 1) % pattern) for i in range(layers)]
    )
    big = layers == 62
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": metadata(reader, "gemma3.attention.sliding_window"),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_local_base_freq": metadata(reader, "gemma3.rope.freq_base_swa", 10000.0),
        "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"]
        if big
        else config["head_dim"],
        "final_logit_softcapping": metadata(reader, "gemma3.final_logit_softcapping", None),
        "attn_logit_softcapping": None,
    }


def _save_tokenizer(
    reader: GGUFFile, gguf_path: Path, out_dir: Path, model_type: str, context_length: int
) -> None:
    """Build the fast tokenizer transformers derives from the GGUF, save it, and check the reload
    matches. Naming the model type picks the class AutoTokenizer would pick from the model's
    config, without its reading that config from the GGUF: for some architectures (Gemma 3)
    that read walks every metadata array, 15 s of Gemma 3 270M's first load."""
    from transformers import AutoTokenizer  # slow import; only needed while converting
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    kind = model_type if model_type in TOKENIZER_MAPPING_NAMES else None
    tokenizer = AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, tokenizer_type=kind
    )
    tokenizer.chat_template = metadata(reader, "tokenizer.chat_template", None)
    tokenizer.model_max_length = context_length
    # Keep the chat template inside tokenizer_config.json (not a side .jinja file) so any reader
    # finds it.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    reloaded = AutoTokenizer.from_pretrained(out_dir)
    write_record(out_dir / TOKENIZER_CLASS_FILE, type(reloaded))  # later loads skip AutoTokenizer
    probes = list(_TOKENIZER_PROBES)
    if tokenizer.chat_template:
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        probes.append(
            tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        )
    for text in probes:
        if tokenizer(text).input_ids != reloaded(text).input_ids:
            raise ValueError(f"{gguf_path}: saved tokenizer does not round-trip {text!r}")


def architecture(reader: GGUFFile, path: Path) -> str:
    """The `general.architecture` value, checked against what the converter supports."""
    arch = metadata(reader, "general.architecture", None)
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    return arch


def metadata(reader: GGUFFile, key: str, default: Any = _MISSING) -> Any:
    """One metadata value, or `default`; a required key that is missing is a clear error."""
    if key in reader.metadata:
        return reader.metadata[key]
    if default is _MISSING:
        raise ValueError(f"GGUF metadata key {key!r} is missing")
    return default
