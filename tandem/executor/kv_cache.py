"""The paged KV cache: how many blocks the budget holds, the device tensor (and a draft model's
layers beside it, in the same slots), the host tier swapped-out requests go to, and whole-block
reads and writes (swap, P/D)."""
from __future__ import annotations

import logging

import torch

from tandem.config import EngineConfig
from tandem.core.outputs import SchedulerOutput
from tandem.executor.device import default_kv_cache_memory
from tandem.models.llama import ModelConfig

log = logging.getLogger(__name__)


class KVCache:
    """[num_layers, 2, slots, num_kv_heads, head_dim] on the device; a block is block_size
    consecutive slots. One allocator and one block table serve the target and a draft model
    with KV of its own (`draft_cfg`): the budget pays for both per block."""

    def __init__(self, config: EngineConfig, cfg: ModelConfig, draft_cfg: ModelConfig | None,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.block_size, self.dtype, self.device = config.block_size, dtype, device
        budget = config.kv_cache_memory or default_kv_cache_memory(device, config.gpu_memory_utilization)
        target_per_block = per_block = cfg.kv_bytes_per_token(dtype) * self.block_size
        if draft_cfg is not None:
            per_block += draft_cfg.kv_bytes_per_token(dtype) * self.block_size
        self.num_kv_blocks = budget // per_block
        if self.num_kv_blocks < 1:
            raise ValueError(f"kv_cache_memory={budget} bytes holds no KV block (one block is {per_block} bytes)")
        self.num_slots = self.num_kv_blocks * self.block_size
        self.kv_cache = self._zeros(cfg)
        self.kv_caches = list(self.kv_cache.unbind(0))  # per layer [2, slots, heads, head_dim]
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB, %s)", self.num_kv_blocks, self.block_size,
                 _mib(self.kv_cache), dtype)
        self.draft_kv_caches = None if draft_cfg is None else list(self._zeros(draft_cfg).unbind(0))
        if self.draft_kv_caches is not None:
            log.info("draft KV cache: %d layers beside the target's (%.1f MiB)", draft_cfg.num_layers,
                     sum(map(_mib, self.draft_kv_caches)))
        self.num_host_blocks = config.swap_space // target_per_block  # a swapped-out draft starts again
        self._host_kv_cache: torch.Tensor | None = None  # allocated at the first swap-out
        self.kv_bytes_per_token = cfg.kv_bytes_per_token(dtype)

    def _zeros(self, cfg: ModelConfig) -> torch.Tensor:
        return torch.zeros(cfg.num_layers, 2, self.num_slots, cfg.num_kv_heads, cfg.head_dim,
                           dtype=self.dtype, device=self.device)

    @property
    def host_kv_cache(self) -> torch.Tensor:
        """The host tier (pinned on GPU machines); zeros, like the device cache, so a
        masked-out slot never holds NaN."""
        if self._host_kv_cache is None:
            _, _, _, heads, dim = self.kv_cache.shape
            self._host_kv_cache = torch.zeros(
                self.kv_cache.shape[0], 2, self.num_host_blocks * self.block_size, heads, dim,
                dtype=self.dtype, device="cpu", pin_memory=self.device.type == "cuda")
        return self._host_kv_cache

    def swap(self, sched: SchedulerOutput) -> None:
        """The step's swaps, out first: before anything can reuse the freed device blocks."""
        if sched.blocks_to_swap_out:
            self._copy(self.kv_cache, self.host_kv_cache, sched.blocks_to_swap_out)
        if sched.blocks_to_swap_in:
            self._copy(self.host_kv_cache, self.kv_cache, sched.blocks_to_swap_in)

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks (all layers, K and V) from src to dst (device and host tiers)."""
        blocks = _read_blocks(src, [a for a, _ in pairs], self.block_size)
        _write_blocks(dst, [b for _, b in pairs], blocks.to(dst.device, non_blocking=True), self.block_size)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy of the blocks' K/V, all layers, on the cache's device."""
        return _read_blocks(self.kv_cache, block_ids, self.block_size)

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor, layer: int | None = None) -> None:
        """Place [num_layers, 2, n, ...] blocks, or one layer's [2, n, ...] when `layer` is given."""
        cache = self.kv_cache
        expect = (self.block_size, *cache.shape[3:])
        if tuple(kv.shape[-3:]) != expect or (layer is None and kv.shape[0] != cache.shape[0]):
            raise ValueError(f"KV payload blocks of shape {tuple(kv.shape)} do not fit this cache "
                             f"({cache.shape[0]} layers of blocks {expect})")
        _write_blocks(cache if layer is None else cache[layer], block_ids, kv.to(self.device, self.dtype),
                      self.block_size)

    def preemption_costs(self) -> tuple[float, float]:
        """Rough seconds per token to swap a request's KV out and back, and to prefill it
        again: what the scheduler weighs when it picks swap or recompute for a victim."""
        copy_bandwidth = 20e9  # host memcpy, or PCIe-class host<->device
        prefill_rate = 50_000.0 if self.device.type == "cuda" else 1_500.0
        return 2 * self.kv_bytes_per_token / copy_bandwidth, 1.0 / prefill_rate


def _mib(t: torch.Tensor) -> float:
    return t.numel() * t.element_size() / 2**20


def _blocks_view(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """[..., 2, slots, heads, dim] as [..., 2, blocks, block_size, heads, dim] (a view)."""
    return cache.view(*cache.shape[:-3], -1, block_size, *cache.shape[-2:])


def _read_blocks(cache: torch.Tensor, block_ids: list[int], block_size: int) -> torch.Tensor:
    blocks = _blocks_view(cache, block_size)
    return blocks.index_select(blocks.dim() - 4, torch.tensor(block_ids, dtype=torch.long, device=cache.device))


def _write_blocks(cache: torch.Tensor, block_ids: list[int], kv: torch.Tensor, block_size: int) -> None:
    blocks = _blocks_view(cache, block_size)
    blocks.index_copy_(blocks.dim() - 4, torch.tensor(block_ids, dtype=torch.long, device=cache.device), kv)
