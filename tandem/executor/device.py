"""Choosing device, dtype and KV cache size for the machine at hand."""
from __future__ import annotations

import numpy as np
import psutil
import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but no CUDA device is available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # AVX-512 CPUs run bf16 matmuls through oneDNN (AMX / AVX512-BF16) several times faster.
    return torch.bfloat16 if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX") else torch.float32


def default_kv_cache_memory(device: torch.device) -> int:
    """A sensible share of what is free: 90% of free GPU memory after the weights were
    loaded, or a quarter of available host memory (at most 2 GiB) on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.9)
    return int(min(psutil.virtual_memory().available * 0.25, 2 << 30))


def to_device(a: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array on the device without a host sync: on CUDA through pinned memory, copied
    asynchronously (torch keeps the pinned buffer alive until the copy is done). A plain
    `.to("cuda")` from pageable memory waits for everything queued on the stream."""
    t = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
