"""The decode side of a simulated P/D handoff: the prompt's full blocks land in the decode
instance's prefix cache (only those it does not hold already), so the real scheduler admits
the continuation with a prefix hit and recomputes just the tail, as the real engine does."""
from __future__ import annotations

from tandem.core.block_pool import hash_block
from tandem.core.kv_cache_manager import KVCacheManager


def import_prompt_blocks(kv: KVCacheManager, token_ids: list[int], dry_run: bool = False) -> int:
    """Cache the prompt's full blocks on `kv`; returns the tokens that had to move (blocks
    already cached there are not sent). With no room, fewer blocks land (the rest is
    recomputed). `dry_run`: count only."""
    bs, pool = kv.block_size, kv.pool
    parent, moved = None, 0
    fresh = []
    for i in range((len(token_ids) - 1) // bs):  # at least one token is always recomputed
        chunk = tuple(token_ids[i * bs:(i + 1) * bs])
        parent = hash_block(parent, chunk)
        if pool.lookup(parent, chunk) is not None:
            continue
        if dry_run:
            moved += bs
            continue
        if pool.num_free_blocks == 0:
            break
        block = pool.get_new_blocks(1)[0]
        pool.cache_block(block, parent, chunk)
        fresh.append(block)
        moved += bs
    pool.free_blocks(list(reversed(fresh)))  # unowned but indexed: the admission takes them
    return moved
