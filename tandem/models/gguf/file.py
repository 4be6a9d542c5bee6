"""A GGUF file's header (metadata scalars, tensor table), and its tensors' bytes read by rows.

`gguf.GGUFReader` builds a numpy view for every item of every metadata array: for a tokenizer
of 262k tokens that is seconds and hundreds of MB of Python objects, held while the weights
load. Loading needs only a few scalars and the tensor table, so this reader steps over arrays
(their strings' lengths are walked, nothing is built), mapping the file only while it parses.
Tensor bytes are then read with positional reads into buffers the decoders free: a mapping
would keep the pages it touched in the process's RSS (dropping them with madvise proved leaky
with the kernel's fault-around), so loading would hold the file beside its serving form. The
The cache folder's config is built from this header too; the tokenizer is left to transformers
(which reads the file once more, with `GGUFReader`).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
# GGUF value type -> struct format of a scalar (8: string, 9: array)
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6
# Arrays of numbers up to this length are read (Gemma 3's per-layer sliding-window pattern);
# longer ones (a tokenizer's scores and token types) are stepped over like strings.
_ARRAY_READ_MAX = 1024


@dataclass(slots=True)
class TensorInfo:
    name: str
    kind: GGMLQuantizationType
    dims: tuple[int, ...]  # innermost first, as GGUF lists them
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def rows(self) -> int:
        return int(np.prod(self.dims[1:])) if len(self.dims) > 1 else 1


class GGUFFile:
    """The header of a GGUF (v2/v3, little-endian); its tensors' bytes on request."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:  # the map is dropped when this returns: the header's pages leave the process
            self.metadata, self.tensors = self._parse(memoryview(np.memmap(self.path, mode="r")))
        except (struct.error, ValueError, IndexError, KeyError) as e:
            raise ValueError(
                f"{self.path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})"
            ) from e
        size = self.path.stat().st_size
        for t in self.tensors:
            if t.offset + t.nbytes > size:
                raise ValueError(
                    f"{self.path}: corrupt or truncated GGUF file "
                    f"(tensor {t.name!r} ends past the end)"
                )
        self._file = open(self.path, "rb", buffering=0)  # read from for the object's life

    def read_rows(self, t: TensorInfo, start: int, stop: int) -> np.ndarray:
        """Rows start:stop of the tensor's bytes: [rows, bytes per row] (fp32 / fp16 tensors: of
        their type), in a fresh buffer."""
        row_bytes = t.nbytes // t.rows
        buf = np.empty((stop - start) * row_bytes, np.uint8)
        view, pos = memoryview(buf), t.offset + start * row_bytes
        while view.nbytes:
            n = os.preadv(self._file.fileno(), [view], pos)
            if n <= 0:
                raise ValueError(f"{self.path}: corrupt or truncated GGUF file (tensor {t.name!r})")
            view, pos = view[n:], pos + n
        if t.kind == GGMLQuantizationType.F32:
            buf = buf.view(np.float32)
        elif t.kind == GGMLQuantizationType.F16:
            buf = buf.view(np.float16)
        return buf.reshape(stop - start, -1)

    def _parse(self, buf: memoryview) -> tuple[dict[str, Any], list[TensorInfo]]:
        if bytes(buf[:4]) != _MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (a big-endian file?) is not supported")
        pos, metadata = 24, {}
        for _ in range(n_kv):
            key, pos = _string(buf, pos)
            (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            metadata[key], pos = _value(buf, pos, vtype)
        tensors = []
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            (n_dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            dims, pos = struct.unpack_from(f"<{n_dims}Q", buf, pos), pos + 8 * n_dims
            (kind, offset), pos = struct.unpack_from("<IQ", buf, pos), pos + 12
            kind = GGMLQuantizationType(kind)
            block, size = GGML_QUANT_SIZES[kind]
            tensors.append(
                TensorInfo(name, kind, tuple(dims), offset, int(np.prod(dims)) * size // block)
            )
        alignment = metadata.get("general.alignment", 32)
        start = -(-pos // alignment) * alignment
        for t in tensors:
            t.offset += start
        return metadata, tensors


def _string(buf: memoryview, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8"), pos + 8 + n


def _value(buf: memoryview, pos: int, vtype: int) -> tuple[Any, int]:
    """(value, position after it). A float32 reads as its shortest decimal (1e-05, not
    9.999999747378752e-06); an array of at most `_ARRAY_READ_MAX` numbers as a list; any other
    array is None, stepped over."""
    if vtype == _STRING:
        return _string(buf, pos)
    if vtype != _ARRAY:
        fmt = _SCALARS[vtype]
        value = struct.unpack_from(fmt, buf, pos)[0]
        return float(str(np.float32(value))) if vtype == _FLOAT32 else value, pos + struct.calcsize(
            fmt
        )
    item, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if item in _SCALARS and count <= _ARRAY_READ_MAX:
        values = []
        for _ in range(count):
            value, pos = _value(buf, pos, item)
            values.append(value)
        return values, pos
    if item == _STRING:
        for _ in range(count):
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
    elif item == _ARRAY:
        for _ in range(count):
            pos = _value(buf, pos, _ARRAY)[1]
    else:
        pos += count * struct.calcsize(_SCALARS[item])
    return None, pos
