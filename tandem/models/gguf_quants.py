"""GGUF Q4_0 / Q4_1 tensors read as int4 codes with per-block scale and zero, for `Int4Linear`.

A block is 32 weights along a row: fp16 d (Q4_1: then fp16 m), then 16 bytes whose low nibbles
are weights 0-15 and high nibbles weights 16-31. Q4_1 means w = d q + m, Q4_0 w = d (q - 8);
in the int4 layer's convention (w = (q - 8) scale + zero) that is scale = d and zero = m + 8 d,
or zero = 0, so the codes are the file's own. llama.cpp permutes the rows of llama q/k weights;
the permutation moves whole rows, so it is undone on the codes and on the block scales alike.
Every other tensor type is left to the float conversion (`gguf_convert.py`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from tandem.models.gguf_convert import hf_tensor_name, unpermute_qk, _meta

GROUP_SIZE = 32
_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}

Int4Codes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes [N, K] uint8, scales, zeros [N, K // 32] fp32


def read_int4_tensors(gguf_path: Path) -> dict[str, Int4Codes]:
    """HF weight name -> (codes, scales, zeros) for every Q4_0 / Q4_1 tensor in the file."""
    reader = GGUFReader(gguf_path)
    arch = _meta(reader, "general.architecture")
    n_head = _meta(reader, f"{arch}.attention.head_count")
    n_head_kv = _meta(reader, f"{arch}.attention.head_count_kv", n_head)
    out = {}
    for t in reader.tensors:
        if t.tensor_type not in _BLOCK_BYTES:
            continue
        codes, scales, zeros = decode_blocks(np.asarray(t.data), t.tensor_type)
        heads = n_head if ".attn_q." in t.name else n_head_kv if ".attn_k." in t.name else None
        if arch == "llama" and heads is not None:
            codes, scales, zeros = (unpermute_qk(a, heads) for a in (codes, scales, zeros))
        out[hf_tensor_name(t.name)] = tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in (codes, scales, zeros))
    return out


def decode_blocks(data: np.ndarray, kind: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[N, bytes per row] raw blocks -> codes [N, K] uint8, scales and zeros [N, K // 32] fp32."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, _BLOCK_BYTES[kind])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == GGMLQuantizationType.Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zeros, qs = m + 8 * d, blocks[..., 4:]
    else:
        zeros, qs = np.zeros_like(d), blocks[..., 2:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(rows, -1)
    return codes, d, zeros
