"""The prefix-cache hit ratio an ideal cache would reach on a workload's exact prompt tokens,
at the engine's block size: the yardstick for what the real cache (server or simulator) got.

A prompt's leading full blocks whose chained hash an earlier prompt had are hits, up to the
last prompt token (which the engine always computes, as `KVCacheManager` does). With
`capacity_blocks`, the ideal cache holds that many blocks, least recently used out first:
"the ideal that the cache size allows" (blocks held by running requests are not modelled)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from tandem.core.block_pool import hash_block


def ideal_prefix_hits(
    prompts: Iterable[Sequence[int]], block_size: int, capacity_blocks: int | None = None
) -> dict:
    """Prompts in arrival order -> prompt tokens, hit tokens and their ratio."""
    if block_size < 1 or (capacity_blocks is not None and capacity_blocks < 1):
        raise ValueError("block_size and capacity_blocks must be >= 1")
    cache: OrderedDict[int, None] = OrderedDict()
    tokens = hits = 0
    for ids in prompts:
        parent, hashes = None, []
        for i in range((len(ids) - 1) // block_size):
            parent = hash_block(parent, tuple(ids[i * block_size : (i + 1) * block_size]))
            hashes.append(parent)
        k = next((i for i, h in enumerate(hashes) if h not in cache), len(hashes))
        tokens, hits = tokens + len(ids), hits + k * block_size
        for h in hashes:
            cache[h] = None
            cache.move_to_end(h)
        while capacity_blocks is not None and len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return {
        "block_size": block_size,
        "capacity_blocks": capacity_blocks,
        "prompt_tokens": tokens,
        "hit_tokens": hits,
        "token_ratio": hits / tokens if tokens else 0.0,
    }
