"""One quantised layer read from a model's weight files in a given format: the file's own Q6_K
or Q8_0 blocks, its 4- and 5-bit codes as int4, or int8 / int4 quantised from floats. A layer is
read a tensor (and a large tensor a slice of rows) at a time, each slice's temporaries handed
back before the next, so loading never holds a layer twice or in floats.
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from tandem.models.gguf.weights import GGUFWeights
from tandem.models.loader.folder_weights import FolderWeights
from tandem.models.quantization import base
from tandem.models.quantization.host_memory import huge_empty, trim_heap
from tandem.models.quantization.int4 import (
    DEFAULT_INT4_GROUP,
    Int4Linear,
    KQuantScales,
    int4_concatenates,
    quantize_int4,
)
from tandem.models.quantization.int8 import Int8Linear, quantize_int8
from tandem.models.quantization.q6k import Q6KLinear, q6k_kernel


class LayerFormat(enum.Enum):
    """What a layer is served as: the file's own Q6_K or Q8_0 blocks, int4 codes (the file's 4-
    or 5-bit ones, or quantised), int8 per output channel (quantised)."""

    Q6_K = enum.auto()
    Q8_0 = enum.auto()
    INT4 = enum.auto()
    INT8 = enum.auto()


def _q6k_linear(
    source: GGUFWeights | FolderWeights,
    names: list[str],
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
    rows_per_chunk: int = 2048,
) -> Q6KLinear:
    """The row-concatenation of `names` (a vocabulary, or a fused layer's parts) from the file's
    own Q6_K blocks, packed a slice of rows at a time."""
    sizes = [source.shape(name) for name in names]
    layer = Q6KLinear(sum(s[0] for s in sizes), sizes[0][1], bias, dtype, device)
    at = 0
    for name, (rows, _) in zip(names, sizes):
        for start in range(0, rows, rows_per_chunk):
            layer.load(
                at + start, *(t.to(device) for t in source.q6k(name, start, start + rows_per_chunk))
            )
            trim_heap()
        at += rows
    return layer


def _q8_0_linear(
    source: GGUFWeights | FolderWeights,
    names: list[str],
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
    rows_per_chunk: int = 4096,
) -> Int8Linear:
    """Int8Linear of the row-concatenation of `names` from the file's own Q8_0 blocks (codes and
    fp16 d per 32), read a slice of rows at a time into the one table."""
    sizes = [source.shape(name) for name in names]
    qweight = huge_empty((sum(s[0] for s in sizes), sizes[0][1]), torch.int8, device)
    d = torch.empty(qweight.shape[0], qweight.shape[1] // 32, dtype=torch.float16, device=device)
    at = 0
    for name, (rows, _) in zip(names, sizes):
        for start in range(0, rows, rows_per_chunk):
            stop = min(start + rows_per_chunk, rows)
            qweight[at + start : at + stop], d[at + start : at + stop] = source.q8_0(
                name, start, stop
            )
            trim_heap()
        at += rows
    return Int8Linear(qweight, d, bias, dtype)


def _int8_linear(
    source: GGUFWeights | FolderWeights,
    names: list[str],
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
    rows_per_chunk: int = 512,
) -> Int8Linear:
    """Int8Linear.from_float of the row-concatenation of `names` (a vocabulary, or a fused
    layer's parts) without holding it in floats: by row slices, each one's temporaries handed
    back before the next."""
    sizes = [source.shape(name) for name in names]
    qweight = huge_empty((sum(s[0] for s in sizes), sizes[0][1]), torch.int8, device)
    scales = torch.empty(qweight.shape[0], dtype=torch.float32, device=device)
    at = 0
    for name, (rows, _) in zip(names, sizes):
        for start in range(0, rows, rows_per_chunk):
            stop = min(start + rows_per_chunk, rows)
            qweight[at + start : at + stop], scales[at + start : at + stop] = quantize_int8(
                source.rows(name, start, stop).to(device)
            )
            trim_heap()
        at += rows
    return Int8Linear(qweight, scales, bias, dtype)


def served_as(
    source: GGUFWeights | FolderWeights,
    name: str,
    weights: str,
    dtype: torch.dtype,
    device: torch.device,
) -> LayerFormat:
    """The format one stored tensor is served in where a variant keeps what the file stores:
    Q6_K and Q8_0 blocks as they are where the integer kernel serves them, 4- and 5-bit codes
    int4 (in int4), anything else int8 per channel."""
    bits, (n, k) = source.code_bits(name), source.shape(name)
    if bits == 6 and q6k_kernel(device, dtype, n, k) is not None:
        return LayerFormat.Q6_K
    if bits == 8 and base.int8_act_kernel(device, dtype, n, k) is not None:
        return LayerFormat.Q8_0
    return LayerFormat.INT4 if weights == "int4" and bits <= 5 else LayerFormat.INT8


def stored_layer(
    fmt: LayerFormat,
    source: GGUFWeights | FolderWeights,
    names: list[str],
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[nn.Module, int]:
    """The layer of tensors `names` (row parts) in format `fmt` (`served_as`), and how many of
    them it holds as the file stores them."""
    if fmt == LayerFormat.Q6_K:
        return _q6k_linear(source, names, bias, dtype, device), len(names)
    if fmt == LayerFormat.Q8_0:
        return _q8_0_linear(source, names, bias, dtype, device), len(names)
    if fmt == LayerFormat.INT4:
        return _int4_linear(source, names, bias, dtype, device)
    return _int8_linear(source, names, bias, dtype, device), 0


def _int4_linear(
    source: GGUFWeights | FolderWeights,
    names: list[str],
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[Int4Linear, int]:
    """An Int4Linear of the row-concatenation of `names`, and how many of them it holds as the
    file's own codes: 4- and 5-bit codes as they are (5 bits where a part has them: 4-bit codes
    are 5-bit codes too), every other part quantised from its floats."""
    bits = 5 if 5 in (source.code_bits(name) for name in names) else 4
    rows = [source.shape(name)[0] for name in names]
    by_part = int4_concatenates(device, dtype, rows, source.shape(names[0])[1])
    pieces, native = [], 0
    for name in names:
        codes = source.int4(name)
        native += codes is not None
        codes = codes or quantize_int4(source.get(name).to(device), DEFAULT_INT4_GROUP, bits)
        # packed as it comes where the kernel serves the layer: one part's one-byte codes at a time
        pieces.append(
            Int4Linear(*(t if t is None else t.to(device) for t in codes), None, dtype, bits)
            if by_part
            else codes
        )
        del codes
    if by_part:
        return Int4Linear.concat(pieces, bias, dtype), native
    codes = torch.cat([piece[0] for piece in pieces]).to(device)
    if all(isinstance(piece[1], KQuantScales) for piece in pieces):  # joined as K-quant factors
        return Int4Linear(
            codes,
            KQuantScales(*(torch.cat(f).to(device) for f in zip(*(p[1] for p in pieces)))),
            None,
            bias,
            dtype,
            bits,
        ), native
    pieces = [
        (c, *s.scales_zeros()) if isinstance(s, KQuantScales) else (c, s, z) for c, s, z in pieces
    ]
    s, z = (torch.cat([piece[i] for piece in pieces]).to(device) for i in (1, 2))
    return Int4Linear(codes, s, z, bias, dtype, bits), native
