"""Tiny transformers models written as GGUF files the way llama.cpp's converter writes them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

# HF name piece -> llama.cpp name piece, written independently of the converter's own table.
_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_TO_GGUF_GEMMA3 = {
    **_TO_GGUF,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _gguf_name(hf_name: str, arch: str = "llama") -> str:
    table = _TO_GGUF_GEMMA3 if arch == "gemma3" else _TO_GGUF
    module, kind = hf_name.rsplit(".", 1)
    if module.startswith("model.layers."):
        layer, part = module[len("model.layers.") :].split(".", 1)
        return f"blk.{layer}.{table[part]}.{kind}"
    return f"{table[module]}.{kind}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute (rotate-half -> interleaved rows)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    model: torch.nn.Module, path: Path, arch: str, rope_scaling: float | None = None
) -> None:
    """Write `model` the way llama.cpp's converter would (q/k permuted for llama only), without a
    tokenizer."""
    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    if getattr(
        c, "head_dim", None
    ):  # llama.cpp writes key/value length only where the config has head_dim
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if rope_scaling:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_scaling)
    if arch == "gemma3":  # what convert_hf_to_gguf's Gemma3Model writes beside the common keys
        writer.add_sliding_window(c.sliding_window)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w = tensor.numpy()
        if arch == "llama" and ".q_proj." in name:
            w = _llama_cpp_permute(w, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = _llama_cpp_permute(w, c.num_key_value_heads)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            w = w + 1  # llama.cpp's norm_shift: Gemma3RMSNorm scales by (1 + w)
        writer.add_tensor(_gguf_name(name, arch), np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
