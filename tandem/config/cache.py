"""The cache section: the paged KV pool (block size, dtype, budget), its host swap tier and the
prefix cache over it."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config.model import FLOAT_DTYPES
from tandem.config.option import option

KV_CACHE_DTYPES = (*FLOAT_DTYPES, "int8", "fp8")


@dataclass(slots=True)
class CacheConfig:
    block_size: int = option(16, "tokens per KV block, a power of two", unit="tokens")
    kv_cache_dtype: str = option(
        "auto",
        "the KV cache's element type; auto: the activations' dtype, but bfloat16 on a CPU that "
        "computes in float32; int8 (CPU): K and V rows in int8 with a one-byte scale per row "
        "of each token and KV head (per 32 values when head_dim is over 64), about half bf16's "
        "bytes, so the pool holds about twice the tokens (1.97x at head_dim 64, 1.94x at "
        "256); fp8 (the Triton kernels, CUDA): the same in e4m3",
        choices=KV_CACHE_DTYPES,
    )
    kv_cache_memory: int | None = option(
        None,
        "the KV pool's size",
        unit="bytes",
        none="90% of free GPU memory after the weights, or on CPU a quarter of available "
        "memory up to 2 GiB",
    )
    gpu_memory_utilization: float | None = option(
        None,
        "size the KV pool from a share of memory instead, in (0, 1]: on CUDA the engine's "
        "share of the device's total memory, as vLLM; on CPU the share of host memory "
        "available after the weights; not with kv_cache_memory",
        unit="fraction",
        none="unset",
    )
    # Bare numbers on the command line are GiB, as vLLM's --swap-space.
    swap_space: int = option(
        512 << 20, "host memory for swapped-out KV blocks", unit="bytes", bare_unit="GiB"
    )
    enable_prefix_caching: bool = option(
        True, "reuse the KV of shared prompt prefixes", yaml="cache.enabled"
    )
    max_prefix_tokens: int | None = option(
        None,
        "tokens of a prompt the prefix cache may serve at most",
        unit="tokens",
        none="no limit",
        yaml="cache.max_prefix_tokens",
    )
    min_match_length: int = option(
        0,
        "tokens a prefix hit must cover to be used",
        unit="tokens",
        yaml="cache.min_match_length",
    )

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                "kv_cache_dtype must be auto, float32, bfloat16, float16, int8 or fp8, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(
                f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}"
            )
        share = self.gpu_memory_utilization
        if share is not None and not 0 < share <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {share}")
        if share is not None and self.kv_cache_memory is not None:
            raise ValueError(
                "kv_cache_memory and gpu_memory_utilization both size the KV pool: give one of them"
            )
