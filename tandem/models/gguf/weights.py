"""A GGUF file's tensors under their Hugging Face names, read one at a time from the file.

A tensor's bytes are read (`gguf/file.py`) and decoded when the builder asks for it (floats in
the Hugging Face layout, a large one a chunk of rows at a time, or a 4-bit format's own int4
codes), so loading holds the serving weights plus one tensor's buffers, never the file and a
float copy of it. Layout differences are undone here: llama.cpp permutes the rows of llama q/k
(whole rows, so codes and block scales are unpermuted alike) and stores Gemma 3's norm weights
as 1 + w. A 3-D expert tensor ([experts, rows, cols]) is one 2-D tensor per expert, named as a
Hugging Face checkpoint names that expert's: its rows are whole blocks, read and decoded alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from tandem.models.gguf.file import GGUFFile, TensorInfo
from tandem.models.gguf.model_folder import SUPPORTED_ARCHS
from tandem.models.gguf.quants import (
    INT4_KINDS,
    K_QUANT_KINDS,
    dequantize_rows,
    int4_rows,
    k_quant_rows,
    q6k_rows,
    q8_0_rows,
)
from tandem.models.quantization.int4 import KQuantScales

# codes [N, K] uint8, then scales, zeros [N, K // 32] fp32, or a K-quant's factors and None
# (Int4Linear's arguments)
Int4Codes = tuple[torch.Tensor, torch.Tensor | KQuantScales, torch.Tensor | None]
Q6KCodes = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor
]  # codes [N, K] uint8, sc [N, K // 16] int8, d [N, K // 256] fp16

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
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
    # a sparse layer's router, and Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Architectures whose layers name some tensors otherwise (Gemma's norms around attention and MLP,
# Mixtral's sparse block).
_ARCH_LAYER_TENSORS = {
    "llama": {**_LAYER_TENSORS, "ffn_gate_inp": "block_sparse_moe.gate"},
    "gemma3": {
        **_LAYER_TENSORS,
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
# llama.cpp's convert_hf_to_gguf stores Gemma 3's RMSNorm weights w as 1 + w (its `norm_shift`,
# the (1 + w) of Gemma3RMSNorm): every `*norm.weight` tensor, undone here.
_NORM_SHIFT = {"gemma3": 1.0}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)")
# A sparse layer's experts in one 3-D tensor each: [experts, rows, cols]; by the projection each
# expert's name holds (Mixtral's, under arch llama, are w1 / w3 / w2 of its block_sparse_moe)
_EXPERTS_NAME = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
_MIXTRAL_EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}
_Q = GGMLQuantizationType
_CODE_BITS = {
    _Q.Q4_0: 4,
    _Q.Q4_1: 4,
    _Q.Q4_K: 4,
    _Q.Q5_0: 5,
    _Q.Q5_1: 5,
    _Q.Q5_K: 5,
    _Q.Q6_K: 6,
    _Q.Q8_0: 8,
    _Q.F16: 16,
    _Q.BF16: 16,
}
# A tensor is decoded this many weights at a time (whole rows): the decoders' temporaries are
# several times their chunk, so a chunk of a 1B model's whole down_proj raised the load's peak.
_WEIGHTS_PER_CHUNK = 1 << 20


@dataclass(slots=True)
class GGUFTensor:
    name: str  # the GGUF name
    kind: GGMLQuantizationType
    shape: tuple[int, ...]  # the Hugging Face shape: [rows, cols] or [n]
    info: TensorInfo  # where its bytes are
    heads: int | None  # llama q/k: the heads llama.cpp permuted the rows in


class GGUFWeights:
    """The tensors of one GGUF file, by Hugging Face name."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.file = GGUFFile(self.path)
        meta = self.file.metadata
        self.arch = meta.get("general.architecture")
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(
                f"{self.path}: unsupported GGUF architecture {self.arch!r} "
                f"(supported: {', '.join(SUPPORTED_ARCHS)})"
            )
        n_head = meta.get(f"{self.arch}.attention.head_count")
        n_head_kv = meta.get(f"{self.arch}.attention.head_count_kv", n_head)
        self.tensors: dict[str, GGUFTensor] = {}
        for t in self.file.tensors:
            experts = expert_names(t.name, self.arch, t.dims[-1])
            if experts:  # each expert a 2-D tensor of its own: its rows of the 3-D one
                for e, name in enumerate(experts):
                    info = expert_rows(t, e)
                    self.tensors[name] = GGUFTensor(t.name, t.kind, info.dims[::-1], info, None)
                continue
            try:
                name = hf_tensor_name(t.name, self.arch)
            except ValueError as e:
                raise ValueError(f"{self.path}: {e}") from e
            heads = None
            if self.arch == "llama" and ".attn_q." in t.name:
                heads = n_head
            elif self.arch == "llama" and ".attn_k." in t.name:
                heads = n_head_kv
            shape = tuple(reversed(t.dims))  # GGUF lists dims innermost first
            if name.endswith("shared_expert_gate.weight"):  # [hidden] or [1, hidden]: one row
                shape = (1, t.dims[0])
            self.tensors[name] = GGUFTensor(t.name, t.kind, shape, t, heads)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, fp32 tensor), one at a time."""
        for name in list(self.tensors):
            yield name, self.get(name)

    def names(self) -> list[str]:
        return list(self.tensors)

    def get(self, name: str) -> torch.Tensor:
        """The tensor dequantised to fp32, in the Hugging Face layout: decoded a chunk of rows at
        a time into the one output array (a large embedding is never held twice)."""
        t = self.tensors[name]
        w = self._decode(t, 0, t.info.rows)
        if t.heads is not None:
            w = np.ascontiguousarray(unpermute_qk(w, t.heads))
        w = w.reshape(t.shape)
        shift = _NORM_SHIFT.get(self.arch)
        if shift and t.name.endswith("norm.weight"):
            w -= np.float32(shift)
        return torch.from_numpy(w)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of a 2-D tensor, fp32: a large one is requantised a slice at a time. A
        permuted q/k is decoded in whole heads (llama.cpp permuted rows within each head)."""
        return self._by_rows(
            name, start, stop, lambda t, first, last: (self._decode(t, first, last),)
        )[0]

    def _by_rows(self, name: str, start: int, stop: int, read) -> tuple[torch.Tensor, ...]:
        """Per-row arrays `read(tensor, first, last)` of rows start:stop of a 2-D tensor, as
        tensors; a permuted q/k is read in whole heads and un-permuted."""
        t = self.tensors[name]
        if len(t.shape) != 2:
            raise ValueError(f"{name}: only a 2-D tensor is read by rows")
        stop = min(stop, t.shape[0])
        if t.heads is None:
            return tuple(torch.from_numpy(a) for a in read(t, start, stop))
        head_rows = t.shape[0] // t.heads
        first, last = start // head_rows * head_rows, -(-stop // head_rows) * head_rows
        arrays = (unpermute_qk(a, (last - first) // head_rows) for a in read(t, first, last))
        return tuple(
            torch.from_numpy(np.ascontiguousarray(a[start - first : stop - first])) for a in arrays
        )

    def raw(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows start:stop of the tensor's bytes as stored: [rows, bytes per row]."""
        t = self.tensors[name]
        return self.file.read_rows(t.info, start, min(stop or t.info.rows, t.info.rows))

    def _decode(self, t: GGUFTensor, start: int, stop: int) -> np.ndarray:
        """Rows start:stop as fp32 [rows, K], decoded a chunk at a time into one array."""
        w = np.empty((stop - start, int(np.prod(t.shape)) // t.info.rows), np.float32)
        rows_per_chunk = max(1, _WEIGHTS_PER_CHUNK // w.shape[1])
        try:
            for i in range(start, stop, rows_per_chunk):
                end = min(i + rows_per_chunk, stop)
                w[i - start : end - start] = dequantize_rows(
                    self.file.read_rows(t.info, i, end), t.kind
                )
        except ValueError as e:
            raise ValueError(f"{self.path}: tensor {t.name!r}: {e}") from e
        return w

    def code_bits(self, name: str) -> int:
        """Bits a weight of this tensor is stored in (its codes'; a float's width)."""
        return _CODE_BITS.get(self.tensors[name].kind, 32)

    def int4(self, name: str) -> Int4Codes | None:
        """The file's own codes, scales and zeros (`gguf_quants.int4_rows`; a K-quant's own factors,
        `k_quant_rows`) where the tensor is of a 4- or 5-bit type the int4 layer reads as it is
        (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K); else None."""
        t = self.tensors[name]
        if t.kind not in INT4_KINDS:
            return None
        decode = k_quant_rows if t.kind in K_QUANT_KINDS else int4_rows
        read = lambda t, first, last: decode(self.file.read_rows(t.info, first, last), t.kind)  # noqa: E731
        codes, *scales = self._by_rows(name, 0, t.info.rows, read)
        return (codes, KQuantScales(*scales), None) if t.kind in K_QUANT_KINDS else (codes, *scales)

    def q6k(self, name: str, start: int, stop: int) -> Q6KCodes:
        """Rows start:stop of a Q6_K tensor's own codes, scales and d (`gguf_quants.q6k_rows`)."""
        t = self.tensors[name]
        if t.kind != _Q.Q6_K:
            raise ValueError(f"{name}: {t.kind.name}, not Q6_K")
        read = lambda t, first, last: q6k_rows(self.file.read_rows(t.info, first, last))  # noqa: E731
        return self._by_rows(name, start, stop, read)

    def q8_0(self, name: str, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows start:stop of a Q8_0 tensor's own codes and d (`gguf_quants.q8_0_rows`)."""
        t = self.tensors[name]
        if t.kind != _Q.Q8_0:
            raise ValueError(f"{name}: {t.kind.name}, not Q8_0")
        read = lambda t, first, last: q8_0_rows(self.file.read_rows(t.info, first, last))  # noqa: E731
        return self._by_rows(name, start, stop, read)


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


def expert_names(gguf_name: str, arch: str, experts: int) -> list[str]:
    """The Hugging Face names of the experts a 3-D expert tensor holds (none for any other)."""
    match = _EXPERTS_NAME.fullmatch(gguf_name)
    if match is None:
        return []
    layer, proj = match[1], match[2]
    if arch == "llama":
        prefix, leaf = f"model.layers.{layer}.block_sparse_moe", _MIXTRAL_EXPERT[proj]
    else:
        prefix, leaf = f"model.layers.{layer}.mlp", f"{proj}_proj"
    return [f"{prefix}.experts.{e}.{leaf}.weight" for e in range(experts)]


def expert_rows(t: TensorInfo, expert: int) -> TensorInfo:
    """Expert `expert` of a 3-D expert tensor: its consecutive rows, as a 2-D tensor (an expert's
    rows are whole blocks, so its bytes are read and decoded as any 2-D tensor's)."""
    nbytes = t.nbytes // t.dims[2]
    return TensorInfo(t.name, t.kind, t.dims[:2], t.offset + expert * nbytes, nbytes)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf `LlamaModel.permute`) for
    rotate-half RoPE."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )
