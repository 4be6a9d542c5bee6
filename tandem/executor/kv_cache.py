"""The paged KV cache: how many blocks the budget holds (and the host tier's swap space), the
device tensor (and a draft model's layers beside it, in the same slots), and whole-block reads
and writes (KV transfer between instances). With KV groups (core/kv_groups.py) the tensor holds
one group's layers per block and each layer reads its group's entries of a request's blocks. An
int8 (fp8) cache's rows hold their scale too (kv_quant.py): what moves rows moves the scales."""

from __future__ import annotations

import logging

import torch

from tandem.config import CacheConfig
from tandem.core.kv_groups import KVGroups, plain_groups
from tandem.executor.device import default_kv_cache_memory
from tandem.executor.kv_quant import kv_bytes_per_token, row_len
from tandem.models.config import ModelConfig

log = logging.getLogger(__name__)


class KVCache:
    """[layers_per_group, 2, slots, num_kv_heads, row] on the device (every layer, in the
    plain layout; row: head_dim, or with its scale bytes for int8 and fp8: kv_quant.row_len); a
    block is block_size consecutive slots. One allocator and one block table serve the target and
    a draft model with KV of its own (`draft_cfg`, plain layout only): the budget pays for both
    per block."""

    def __init__(
        self,
        config: CacheConfig,
        cfg: ModelConfig,
        draft_cfg: ModelConfig | None,
        dtype: torch.dtype,
        device: torch.device,
        groups: KVGroups | None = None,
    ) -> None:
        self.block_size, self.dtype, self.device = config.block_size, dtype, device
        self.groups = groups = groups or plain_groups(cfg.num_layers)
        if draft_cfg is not None and groups.num_groups > 1:
            raise ValueError("a draft model with KV of its own needs the plain KV layout")
        budget = config.kv_cache_memory or default_kv_cache_memory(
            device, config.gpu_memory_utilization
        )
        layer_bytes = kv_bytes_per_token(cfg, dtype) // cfg.num_layers
        target_per_block = per_block = layer_bytes * groups.layers_per_group * self.block_size
        if draft_cfg is not None:
            per_block += kv_bytes_per_token(draft_cfg, dtype) * self.block_size
        self.num_kv_blocks = budget // per_block
        if self.num_kv_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={budget} bytes holds no KV block (one block is {per_block} bytes)"
            )
        # one block more for the KV manager's null block, where a sliding group's freed entries
        # point
        self.num_slots = (
            self.num_kv_blocks + any(w is not None for w in groups.windows)
        ) * self.block_size
        self.kv_cache = self._zeros(cfg, groups.layers_per_group)
        rows = self.kv_cache.unbind(0)
        self.kv_caches = [
            rows[row] for _, row in groups.layer_slots
        ]  # per layer [2, slots, heads, head_dim]
        log.info(
            "KV cache: %d blocks of %d tokens x %d layers, %d group(s) (%.1f MiB, %s)",
            self.num_kv_blocks,
            self.block_size,
            groups.layers_per_group,
            groups.num_groups,
            _mib(self.kv_cache),
            dtype,
        )
        self.draft_kv_caches = (
            None
            if draft_cfg is None
            else list(self._zeros(draft_cfg, draft_cfg.num_layers).unbind(0))
        )
        if self.draft_kv_caches is not None:
            log.info(
                "draft KV cache: %d layers beside the target's (%.1f MiB)",
                draft_cfg.num_layers,
                sum(map(_mib, self.draft_kv_caches)),
            )
        self.num_host_blocks = (
            config.swap_space // target_per_block
        )  # a swapped-out draft starts again
        self.kv_bytes_per_token = kv_bytes_per_token(cfg, dtype)

    def _zeros(self, cfg: ModelConfig, rows: int) -> torch.Tensor:
        return torch.zeros(
            rows,
            2,
            self.num_slots,
            cfg.num_kv_heads,
            row_len(cfg.head_dim, self.dtype),
            dtype=self.dtype,
            device=self.device,
        )

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy of the blocks' K/V, all layers, on the cache's device:
        [num_layers, 2, n, ...] for the n logical blocks whose entries `block_ids` lists (G
        each): the plain layout's payload, whatever the grouping."""
        if self.groups.num_groups == 1:
            return gather_blocks(self.kv_cache, block_ids, self.block_size)
        ids = self._entries(block_ids)
        return torch.stack(
            [
                gather_blocks(self.kv_caches[layer], ids[:, k].tolist(), self.block_size)
                for layer, (k, _) in enumerate(self.groups.layer_slots)
            ]
        )

    def write_blocks(
        self, block_ids: list[int], kv: torch.Tensor, layer: int | None = None
    ) -> None:
        """Place [num_layers, 2, n, ...] blocks, or one layer's [2, n, ...] when `layer` is given,
        into the n logical blocks whose entries `block_ids` lists."""
        num_layers = len(self.groups.layer_slots)
        expect = (self.block_size, *self.kv_cache.shape[3:])
        if tuple(kv.shape[-3:]) != expect or (layer is None and kv.shape[0] != num_layers):
            raise ValueError(
                f"KV payload blocks of shape {tuple(kv.shape)} do not fit this cache "
                f"({num_layers} layers of blocks {expect})"
            )
        kv = kv.to(self.device, self.dtype)
        if self.groups.num_groups == 1:
            cache = self.kv_cache if layer is None else self.kv_cache[layer]
            scatter_blocks(cache, block_ids, kv, self.block_size)
            return
        ids = self._entries(block_ids)
        for i in range(num_layers) if layer is None else (layer,):
            k = self.groups.layer_slots[i][0]
            scatter_blocks(
                self.kv_caches[i],
                ids[:, k].tolist(),
                kv[i] if layer is None else kv,
                self.block_size,
            )

    def _entries(self, block_ids: list[int]) -> torch.Tensor:
        """Flat entries (G per logical block) as [n, G]."""
        G = self.groups.num_groups
        if len(block_ids) % G:
            raise ValueError(
                f"{len(block_ids)} block entries are not whole logical blocks of {G} groups"
            )
        return torch.tensor(block_ids, dtype=torch.long).view(-1, G)

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


def gather_blocks(cache: torch.Tensor, block_ids: list[int], block_size: int) -> torch.Tensor:
    blocks = _blocks_view(cache, block_size)
    return blocks.index_select(
        blocks.dim() - 4, torch.tensor(block_ids, dtype=torch.long, device=cache.device)
    )


def scatter_blocks(
    cache: torch.Tensor, block_ids: list[int], kv: torch.Tensor, block_size: int
) -> None:
    if cache.dtype == torch.float8_e4m3fn:  # a CPU copy (the host tier's) takes no fp8
        cache, kv = cache.view(torch.uint8), kv.view(torch.uint8)
    blocks = _blocks_view(cache, block_size)
    blocks.index_copy_(
        blocks.dim() - 4, torch.tensor(block_ids, dtype=torch.long, device=cache.device), kv
    )
