"""Choosing device, dtype and KV cache size for the machine at hand."""

from __future__ import annotations

import numpy as np
import psutil
import torch

from tandem.config import AttentionBackend

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
    return (
        torch.bfloat16
        if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AMX")
        else torch.float32
    )


def resolve_kv_cache_dtype(
    name: str,
    dtype_name: str,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: AttentionBackend,
) -> torch.dtype:
    """The KV cache's element type, for activations in `dtype` (`dtype_name` as asked for).

    auto: the activations' dtype, except on a CPU where an auto `dtype` computes in fp32 (no
    AVX-512, whose bf16 matmuls it lacks): there the cache is bf16, as an AVX-512 CPU keeps it
    (llama.cpp keeps f16). Decode attention reads the whole context every step, and half the
    bytes takes ~40% off its time; the pool holds twice the tokens. A cache narrower than the
    activations (bf16 or fp16 under fp32) is read by the CPU attention alone: refused elsewhere,
    and so is int8 (rows quantised with a scale each: executor/kv_quant.py); fp8 is the same for
    the Triton kernels alone."""
    if name == "int8":
        if device.type != "cpu" or attention_backend != AttentionBackend.TORCH:
            raise ValueError(
                f"kv_cache_dtype int8 runs on the CPU attention only (device {device}, attention "
                f"backend {attention_backend}); the Triton kernels take fp8"
            )
        return torch.int8
    if name == "fp8":
        if attention_backend != AttentionBackend.TRITON:
            raise ValueError(
                f"kv_cache_dtype fp8 runs on the Triton kernels only (attention backend "
                f"{attention_backend}); the CPU attention takes int8"
            )
        return torch.float8_e4m3fn
    if name == "auto":
        native = device.type == "cpu" and attention_backend == AttentionBackend.TORCH
        narrow = native and dtype_name == "auto"
        return torch.bfloat16 if narrow and dtype == torch.float32 else dtype
    kv_dtype = _DTYPES[name]
    if kv_dtype == dtype:
        return kv_dtype
    if dtype != torch.float32 or kv_dtype == torch.float32:
        raise ValueError(
            f"kv_cache_dtype {name} under {str(dtype).removeprefix('torch.')} activations: "
            "the cache holds the activations' dtype, or bfloat16 / float16 under float32"
        )
    if device.type != "cpu" or attention_backend != AttentionBackend.TORCH:
        raise ValueError(
            f"kv_cache_dtype {name} under float32 activations runs on the CPU attention only "
            f"(device {device}, attention backend {attention_backend}); use the activations' dtype"
        )
    return kv_dtype


def default_kv_cache_memory(device: torch.device, memory_utilization: float | None = None) -> int:
    """The KV pool's bytes when no size was given, measured after the weights were loaded.

    With `memory_utilization` (vLLM's --gpu-memory-utilization): on CUDA, the engine may use
    that fraction of the device's total memory, so the pool is what is free beyond the rest;
    on CPU, that fraction of the host memory still available. Without it: 90% of free GPU
    memory, or a quarter of available host memory up to 2 GiB (a CPU host runs other things)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = (
            free * 0.9 if memory_utilization is None else free - (1 - memory_utilization) * total
        )
    else:
        available = psutil.virtual_memory().available
        budget = (
            min(available * 0.25, 2 << 30)
            if memory_utilization is None
            else available * memory_utilization
        )
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={memory_utilization} leaves no memory for the KV pool: "
            f"more than that share of the device is in use already"
        )
    return int(budget)


def to_device(a: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array on the device without a host sync: on CUDA through pinned memory, copied
    asynchronously (torch keeps the pinned buffer alive until the copy is done). A plain
    `.to("cuda")` from pageable memory waits for everything queued on the stream."""
    t = torch.from_numpy(a) if isinstance(a, np.ndarray) else a
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
