"""Per-request block tables over the block pool, prefix-cache lookups, and usage figures."""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from tandem.core.block_pool import BlockPool, KVBlock, hash_block, salt_hash
from tandem.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True, eq=False)
class KVReservation:
    """Blocks held for KV computed on another instance (P/D): the request's quota here,
    taken before the transfer. `blocks[i]` holds block i of `token_ids`; those listed in
    `fresh` are to be written, the rest were already cached here and are only pinned."""

    token_ids: list[int]
    hashes: list[int]
    blocks: list[KVBlock]
    fresh: list[int]


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from the cache
    requests: int = 0
    requests_hit: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_caching: bool = True,
        max_prefix_tokens: int | None = None,
        min_match_length: int = 0,
        num_host_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_caching = enable_caching
        self.max_prefix_tokens = max_prefix_tokens
        self.min_match_length = min_match_length
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self._req_hashes: dict[str, list[int]] = {}  # hashes of the request's full blocks, chained
        self._req_tokens: dict[str, int] = {}  # tokens whose KV the request holds
        self.stats = PrefixCacheStats()
        # Host tier for swapped-out requests. Blocks freed by a swap-in are only reusable at
        # the next step, so a swap-out in the same step cannot overwrite them before they are read.
        self.num_host_blocks = num_host_blocks
        self._host_free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self._host_pending: list[int] = []
        self.req_to_host_blocks: dict[str, list[int]] = {}

    # ---- prefix cache -------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request's tokens, in whole blocks. At least one
        token is always left to compute, so the step still produces logits."""
        if not self.enable_caching:
            return [], 0
        limit = req.num_tokens - 1
        if self.max_prefix_tokens is not None:
            limit = min(limit, self.max_prefix_tokens)
        bs, tokens, blocks = self.block_size, req.all_token_ids, []
        parent = salt_hash(req.cache_salt)
        for i in range(limit // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            parent = hash_block(parent, chunk)
            block = self.pool.lookup(parent, chunk)
            if block is None:
                break
            blocks.append(block)
        num_hit = len(blocks) * bs
        if num_hit < max(self.min_match_length, 1):
            blocks, num_hit = [], 0
        return blocks, num_hit

    def record_prefix_query(self, req: Request, num_hit: int) -> None:
        """Count a request once, when it is first admitted."""
        if self.enable_caching:
            self.stats.requests += 1
            self.stats.queries += req.num_prompt_tokens
            self.stats.hits += num_hit
            self.stats.requests_hit += num_hit > 0

    def cache_blocks(self, req: Request) -> None:
        """Index the request's full blocks whose KV is computed (call after the step ran)."""
        if not self.enable_caching:
            return
        blocks = self.req_to_blocks.get(req.request_id)
        if not blocks:
            return
        hashes = self._req_hashes.setdefault(req.request_id, [])
        bs, tokens = self.block_size, req.all_token_ids
        # Known tokens only: a verify step in flight has num_computed_tokens past them, over
        # drafts not yet accepted (speculative decoding).
        limit = min(req.num_computed_tokens, len(tokens))
        if self.max_prefix_tokens is not None:
            limit = min(limit, self.max_prefix_tokens)
        for i in range(len(hashes), min(limit // bs, len(blocks))):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = hash_block(hashes[-1] if hashes else salt_hash(req.cache_salt), chunk)
            hashes.append(h)
            self.pool.cache_block(blocks[i], h, chunk)

    # ---- KV computed elsewhere (P/D) ----------------------------------------------
    def _chunks(self, token_ids: list[int]) -> Iterator[tuple[int, tuple[int, ...]]]:
        """(chained hash, token ids) of each whole block of `token_ids` a prefix lookup may reach."""
        bs, parent = self.block_size, None
        limit = len(token_ids) if self.max_prefix_tokens is None else min(len(token_ids), self.max_prefix_tokens)
        for i in range(limit // bs):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            parent = hash_block(parent, chunk)
            yield parent, chunk

    def cached_prefix(self, token_ids: list[int]) -> list[KVBlock]:
        """The longest run of whole blocks of `token_ids` in the prefix cache (nothing taken)."""
        blocks = []
        for h, chunk in self._chunks(token_ids):
            block = self.pool.lookup(h, chunk)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def reserve(self, token_ids: list[int]) -> KVReservation | None:
        """Hold a block for each whole block of `token_ids` a later prefix lookup would reach,
        pinning those cached here already. None when blocks are short (nothing changed then)."""
        chunks = list(self._chunks(token_ids))
        hits = [self.pool.lookup(h, chunk) for h, chunk in chunks]
        fresh = [i for i, b in enumerate(hits) if b is None]
        pinned = [b for b in hits if b is not None]
        if len(fresh) > self.pool.num_free_blocks - sum(1 for b in pinned if b.ref_cnt == 0):
            return None
        self.pool.touch(pinned)
        new = iter(self.pool.get_new_blocks(len(fresh)))
        blocks = [b if b is not None else next(new) for b in hits]
        return KVReservation(list(token_ids[:len(chunks) * self.block_size]), [h for h, _ in chunks], blocks, fresh)

    def commit(self, res: KVReservation, num_blocks: int) -> None:
        """Index the first `num_blocks` blocks, now written, in the prefix cache, and give
        back the rest (the sender had fewer). The reservation still pins what it keeps."""
        bs = self.block_size
        for i in res.fresh:
            if i < num_blocks:
                self.pool.cache_block(res.blocks[i], res.hashes[i], tuple(res.token_ids[i * bs:(i + 1) * bs]))
        self.pool.free_blocks(list(reversed(res.blocks[num_blocks:])))
        del res.blocks[num_blocks:], res.hashes[num_blocks:], res.token_ids[num_blocks * bs:]
        res.fresh = [i for i in res.fresh if i < num_blocks]

    def release(self, res: KVReservation) -> None:
        """Drop the reservation's pins (tail first); committed blocks stay cached, evictable."""
        self.pool.free_blocks(list(reversed(res.blocks)))
        res.blocks.clear()

    # ---- allocation ---------------------------------------------------------------
    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after `req.num_computed_tokens`
        (plus `computed_blocks`, prefix hits taken now). Returns the new block ids, or
        None when there are not enough free blocks (nothing is changed then)."""
        computed_blocks = computed_blocks or []
        blocks = self.req_to_blocks.setdefault(req.request_id, [])
        total = req.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = cdiv(total, self.block_size) - len(blocks) - len(computed_blocks)
        # Hits that sit unowned in the LRU count as free now; touching them takes them.
        reusable = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - reusable:
            if not blocks:
                del self.req_to_blocks[req.request_id]
            return None
        self.pool.touch(computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(need, 0))
        blocks.extend(computed_blocks)
        blocks.extend(new_blocks)
        self._req_tokens[req.request_id] = total
        return [b.block_id for b in computed_blocks + new_blocks]

    # ---- host tier (swap) -----------------------------------------------------------
    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free)

    def num_cached_blocks(self, req: Request) -> int:
        """The request's blocks that sit in the prefix index (they survive a recompute preemption)."""
        return sum(1 for b in self.req_to_blocks.get(req.request_id, ()) if b.block_hash is not None)

    def swap_out(self, req: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the host tier: (device, host) pairs to copy, or None
        when the host pool lacks room (nothing changed then)."""
        blocks = self.req_to_blocks.get(req.request_id, [])
        if not blocks or len(blocks) > len(self._host_free):
            return None
        host = [self._host_free.pop() for _ in blocks]
        pairs = [(b.block_id, h) for b, h in zip(blocks, host)]
        self.free(req)
        self.req_to_host_blocks[req.request_id] = host
        return pairs

    def swap_in(self, req: Request, num_new_tokens: int) -> tuple[list[tuple[int, int]], list[int]] | None:
        """Bring a swapped request back with room for `num_new_tokens` more: (host, device)
        pairs to copy and all its device block ids, or None when device blocks are short."""
        host = self.req_to_host_blocks[req.request_id]
        total = req.num_computed_tokens + num_new_tokens
        need = max(cdiv(total, self.block_size), len(host))
        if need > self.pool.num_free_blocks:
            return None
        blocks = self.pool.get_new_blocks(need)
        self.req_to_blocks[req.request_id] = blocks
        self._req_tokens[req.request_id] = total
        del self.req_to_host_blocks[req.request_id]
        self._host_pending.extend(host)
        return [(h, b.block_id) for h, b in zip(host, blocks)], [b.block_id for b in blocks]

    def release_pending_host_blocks(self) -> None:
        self._host_free.extend(self._host_pending)
        self._host_pending.clear()

    def free(self, req: Request) -> None:
        host = self.req_to_host_blocks.pop(req.request_id, None)
        if host:
            self._host_free.extend(host)
        blocks = self.req_to_blocks.pop(req.request_id, None)
        self._req_hashes.pop(req.request_id, None)
        self._req_tokens.pop(req.request_id, None)
        if blocks:
            self.pool.free_blocks(list(reversed(blocks)))

    def block_ids(self, req: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req.request_id, ())]

    # ---- figures ------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_swapped(self) -> int:
        """Requests whose KV is in the host pool."""
        return len(self.req_to_host_blocks)

    def newest_cached_hashes(self, limit: int) -> list[int]:
        """The hashes of up to `limit` cached blocks, newest first (the pool keeps caching order)."""
        return list(itertools.islice(reversed(self.pool.cached_hashes), limit))

    @property
    def usage(self) -> float:
        """Share of blocks owned by requests (cached-but-unowned blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def utilization(self) -> float:
        """Tokens stored / token capacity of the blocks owned: internal fragmentation."""
        num_blocks = sum(len(b) for b in self.req_to_blocks.values())
        if not num_blocks:
            return 1.0
        return sum(self._req_tokens.values()) / (num_blocks * self.block_size)

