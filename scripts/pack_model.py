"""Shrink a Hugging Face model folder to travel to a GPU machine (64 MiB for the whole tree),
and restore it there.

`pack SRC DST`: every matrix is re-quantised to 3 bits, the embedding to 4 (asymmetric, groups
of 64 along a row, fp16 minimum and step), vectors stay fp16; with the config files.
`unpack SRC DST`: the folder again, fp32 safetensors. The weights are a lossy copy of the
model's (3-bit on top of Q4_1): tandem and transformers both load this same folder, so greedy
equality between them is a fair test, and step times (same shapes and dtype) are the model's,
but its text is worse than the original's.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

GROUP = 64
EMBED_BITS, BITS = 4, 3  # the (tied) embedding is also the LM head: it gets the extra bit
# No tokenizer (3.4 MiB for SmolLM2): the checks send token ids.
COPIED = ("config.json", "generation_config.json")


def _pack_matrix(w: np.ndarray, bits: int) -> dict[str, np.ndarray]:
    groups = w.reshape(-1, GROUP)
    lo, hi = groups.min(1, keepdims=True), groups.max(1, keepdims=True)
    step = np.maximum((hi - lo) / (2**bits - 1), 1e-8)
    codes = np.clip(np.rint((groups - lo) / step), 0, 2**bits - 1).astype(np.uint8).ravel()
    planes = np.stack([np.packbits((codes >> k) & 1) for k in range(bits)])
    return {"planes": planes, "lo": lo.astype(np.float16), "step": step.astype(np.float16)}


def _unpack_matrix(
    planes: np.ndarray, lo: np.ndarray, step: np.ndarray, shape: tuple[int, ...]
) -> np.ndarray:
    n = int(np.prod(shape))
    codes = sum(np.unpackbits(planes[k], count=n).astype(np.uint8) << k for k in range(len(planes)))
    groups = lo.astype(np.float32) + step.astype(np.float32) * codes.reshape(-1, GROUP)
    return groups.reshape(shape)


def pack(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    for file in sorted(src.glob("*.safetensors")):
        for name, t in load_file(file).items():
            w = t.float().numpy()
            if w.ndim == 2 and w.shape[1] % GROUP == 0:
                for key, a in _pack_matrix(
                    w, EMBED_BITS if "embed_tokens" in name else BITS
                ).items():
                    arrays[f"{name}|{key}"] = a
                arrays[f"{name}|shape"] = np.array(w.shape)
            else:
                arrays[f"{name}|raw"] = w.astype(np.float16)
    np.savez_compressed(dst / "weights.npz", **arrays)
    for name in COPIED:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    size = sum(f.stat().st_size for f in dst.iterdir())
    print(f"{dst}: {size / 2**20:.1f} MiB")


def unpack(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    data = np.load(src / "weights.npz")
    names = sorted({k.split("|")[0] for k in data.files})
    tensors = {}
    for name in names:
        if f"{name}|raw" in data.files:
            tensors[name] = torch.from_numpy(data[f"{name}|raw"].astype(np.float32))
        else:
            shape = tuple(int(x) for x in data[f"{name}|shape"])
            tensors[name] = torch.from_numpy(
                _unpack_matrix(
                    data[f"{name}|planes"], data[f"{name}|lo"], data[f"{name}|step"], shape
                )
            )
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name in COPIED:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    print(f"{dst}: {len(tensors)} tensors")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("pack", "unpack"):
        sys.exit("usage: pack_model.py pack|unpack SRC DST")
    (pack if sys.argv[1] == "pack" else unpack)(Path(sys.argv[2]), Path(sys.argv[3]))
