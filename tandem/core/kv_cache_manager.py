"""Per-request block tables over the block pool, prefix-cache lookups, and usage figures.

With several KV groups (core/kv_groups.py: sliding-window and full-attention layers apart), a
request's blocks are one flat list, G per logical block of block_size tokens: entry i * G + k is
group k's block for tokens [i * bs, (i + 1) * bs). A sliding-window group's entries behind the
window of the request's next query are freed and replaced by `null_block` (block 0, never
allocated to anyone, never read unmasked), so only the window's blocks stay held."""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tandem.core.block_pool import BlockPool, KVBlock, hash_block, salt_hash
from tandem.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVPoolFullError(RuntimeError):
    """Too few free KV blocks here for a transfer (P/D): send it to another instance, or wait."""


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
        group_windows: tuple[int | None, ...] = (None,),
    ) -> None:
        self.block_size = block_size
        self.group_windows = group_windows
        self.num_groups = len(group_windows)
        self._full_groups = [k for k, w in enumerate(group_windows) if w is None]
        # Where a sliding group's freed entries point: one block past the `num_blocks` served (the
        # executor allocates it), taken first, so it is block 0 (the pad of every block table),
        # and held for good.
        sliding = any(w is not None for w in group_windows)
        self.pool = BlockPool(num_blocks + sliding)
        self.null_block = self.pool.get_new_blocks(1)[0] if sliding else None
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
        self.req_to_host_blocks: dict[str, list[int | None]] = {}  # aligned with the blocks; None: null
        self._req_dead: dict[str, int] = {}  # logical blocks before this are freed in every sliding group

    # ---- layout -------------------------------------------------------------------
    def _live_from(self, k: int, pos: int) -> int:
        """The first logical block group k still reads for queries at `pos` and after (a query at
        p sees keys p - window + 1 .. p)."""
        window = self.group_windows[k]
        return 0 if window is None else max(0, pos - window + 1) // self.block_size

    def _real(self, blocks: list[KVBlock]) -> list[KVBlock]:
        return blocks if self.null_block is None else [b for b in blocks if b is not self.null_block]

    def _dead(self, req: Request) -> list[int]:
        """Entries of the request's blocks that its next query no longer reads, not yet freed."""
        blocks, G = self.req_to_blocks.get(req.request_id), self.num_groups
        if not blocks or self.null_block is None:
            return []
        pos, start = req.num_computed_tokens, self._req_dead.get(req.request_id, 0)
        return [i * G + k for k, w in enumerate(self.group_windows) if w is not None
                for i in range(start, min(self._live_from(k, pos), len(blocks) // G))
                if blocks[i * G + k] is not self.null_block]

    def _free_dead(self, req: Request) -> None:
        """Give back the blocks behind the request's sliding windows (theirs alone go free; a
        block a prefix hit shares stays with its other owners)."""
        dead = self._dead(req)
        if not dead:
            return
        # Indexed first: under async scheduling the step that computed them may still be running
        # (it runs before any step that could hit them), and a later prompt with this prefix
        # needs the window's blocks before its end.
        self.cache_blocks(req)
        blocks = self.req_to_blocks[req.request_id]
        self.pool.free_blocks([blocks[e] for e in reversed(dead)])
        for e in dead:
            blocks[e] = self.null_block
        live = min(self._live_from(k, req.num_computed_tokens)
                   for k, w in enumerate(self.group_windows) if w is not None)
        self._req_dead[req.request_id] = min(live, len(blocks) // self.num_groups)

    def blocks_needed(self, req: Request, num_new: int, computed_blocks: Sequence[KVBlock] = ()) -> int:
        """Free blocks `allocate_slots` (or `swap_in`, for a swapped request) would take for
        `num_new` more tokens: new ones, less those freed behind sliding windows, plus unowned
        prefix hits. May be negative (a step that frees more than it takes)."""
        G, host = self.num_groups, self.req_to_host_blocks.get(req.request_id)
        if host is not None:
            total = req.num_computed_tokens + num_new
            return sum(h is not None for h in host) + max(cdiv(total, self.block_size) - len(host) // G, 0) * G
        have = (len(self.req_to_blocks.get(req.request_id, ())) + len(computed_blocks)) // G
        total = req.num_computed_tokens + len(computed_blocks) // G * self.block_size + num_new
        held = self.req_to_blocks.get(req.request_id, [])
        freed = sum(1 for e in self._dead(req) if held[e].ref_cnt == 1)
        reusable = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        return max(cdiv(total, self.block_size) - have, 0) * G + reusable - freed

    def token_room(self, req: Request, free_blocks: int) -> int:
        """Tokens past the request's computed ones that its blocks plus `free_blocks` more hold."""
        have = len(self.req_to_blocks.get(req.request_id, ())) // self.num_groups
        return (have + max(free_blocks, 0) // self.num_groups) * self.block_size - req.num_computed_tokens

    def token_capacity(self, max_chunk: int) -> int:
        """The longest request the pool can hold alone, prefilled in chunks of at most `max_chunk`
        tokens: a sliding group holds at most its window plus one chunk at a time."""
        G, bs = self.num_groups, self.block_size
        usable = self.num_blocks
        sliding = [w for w in self.group_windows if w is not None]
        if not sliding:
            return usable // G * bs
        span = max(cdiv(w - 1 + max_chunk, bs) + 1 for w in sliding)  # logical blocks a sliding group holds
        if G * span >= usable:
            return usable // G * bs  # the pool runs out before any window frees a block
        if not self._full_groups:
            return 1 << 40  # every layer windowed: any length fits
        return (span + (usable - G * span) // len(self._full_groups)) * bs

    # ---- prefix cache -------------------------------------------------------------
    def _group_key(self, block_hash: int, k: int) -> int:
        """Group k's index key for a block of tokens (group 0: the chained hash itself, what
        routers match)."""
        return block_hash if k == 0 else hash_block(block_hash, (-1 - k,))

    def _chunks(self, token_ids: list[int], parent: int | None, num_blocks: int
                ) -> Iterator[tuple[int, list[KVBlock | None]]]:
        """(chained hash, each group's cached block or None) of the first `num_blocks` whole
        blocks of `token_ids`."""
        bs = self.block_size
        for i in range(num_blocks):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            parent = hash_block(parent, chunk)
            yield parent, [self.pool.lookup(self._group_key(parent, k), chunk) for k in range(self.num_groups)]

    def _longest_hit(self, token_ids: list[int], parent: int | None, num_blocks: int) -> list[KVBlock]:
        """The longest run of logical blocks of `token_ids` (at most `num_blocks`) the prefix
        cache holds for every group that a query right after it reads, as flat entries (the null
        block where a sliding group no longer reads)."""
        G, bs = self.num_groups, self.block_size
        found: list[list[KVBlock | None]] = []
        for _, row in self._chunks(token_ids, parent, num_blocks):
            if any(row[k] is None for k in self._full_groups):
                break
            found.append(row)
        n = len(found)
        while n and any(found[i][k] is None for k, w in enumerate(self.group_windows) if w is not None
                        for i in range(self._live_from(k, n * bs), n)):
            n -= 1
        return [found[i][k] if i >= self._live_from(k, n * bs) else self.null_block
                for i in range(n) for k in range(G)]

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request's tokens, in whole blocks (flat entries, see
        the module's docstring). At least one token is always left to compute, so the step
        still produces logits. No hit for a request that asks for prompt logprobs: every
        prompt position must run for its logits."""
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            return [], 0
        limit = req.num_tokens - 1
        if self.max_prefix_tokens is not None:
            limit = min(limit, self.max_prefix_tokens)
        blocks = self._longest_hit(req.all_token_ids, salt_hash(req.cache_salt), limit // self.block_size)
        num_hit = len(blocks) // self.num_groups * self.block_size
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
        G = self.num_groups
        hashes = self._req_hashes.setdefault(req.request_id, [])
        bs, tokens = self.block_size, req.all_token_ids
        # Known tokens only: a verify step in flight has num_computed_tokens past them, over
        # drafts not yet accepted (speculative decoding).
        limit = min(req.num_computed_tokens, len(tokens))
        if self.max_prefix_tokens is not None:
            limit = min(limit, self.max_prefix_tokens)
        for i in range(len(hashes), min(limit // bs, len(blocks) // G)):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = hash_block(hashes[-1] if hashes else salt_hash(req.cache_salt), chunk)
            hashes.append(h)
            for k in range(G):
                if blocks[i * G + k] is not self.null_block:  # a prefix hit's, behind the window
                    self.pool.cache_block(blocks[i * G + k], self._group_key(h, k), chunk)

    # ---- KV computed elsewhere (P/D) ----------------------------------------------
    def _num_transfer_blocks(self, token_ids: list[int]) -> int:
        limit = len(token_ids) if self.max_prefix_tokens is None else min(len(token_ids), self.max_prefix_tokens)
        return limit // self.block_size

    def cached_prefix(self, token_ids: list[int]) -> list[KVBlock]:
        """The longest run of whole blocks of `token_ids` in the prefix cache, as flat entries
        (nothing taken)."""
        return self._longest_hit(token_ids, None, self._num_transfer_blocks(token_ids))

    def reserve(self, token_ids: list[int]) -> KVReservation | None:
        """Hold a block for each whole block of `token_ids` a later prefix lookup would reach
        (each group's, the null block where a sliding group would not read it), pinning those
        cached here already. None when blocks are short (nothing changed then)."""
        G, bs = self.num_groups, self.block_size
        n, hashes = self._num_transfer_blocks(token_ids), []
        hits: list[KVBlock | None] = []
        for i, (h, row) in enumerate(self._chunks(token_ids, None, n)):
            hashes.append(h)
            hits.extend(self.null_block if i < self._live_from(k, n * bs) else row[k] for k in range(G))
        fresh = [e for e, b in enumerate(hits) if b is None]
        pinned = self._real([b for b in hits if b is not None])
        if len(fresh) > self.pool.num_free_blocks - sum(1 for b in pinned if b.ref_cnt == 0):
            return None
        self.pool.touch(pinned)
        new = iter(self.pool.get_new_blocks(len(fresh)))
        blocks = [b if b is not None else next(new) for b in hits]
        return KVReservation(list(token_ids[:n * bs]), hashes, blocks, fresh)

    def commit(self, res: KVReservation, num_blocks: int) -> None:
        """Index the first `num_blocks` logical blocks, now written, in the prefix cache, and
        give back the rest (the sender had fewer). The reservation still pins what it keeps."""
        G, bs = self.num_groups, self.block_size
        for e in res.fresh:
            i = e // G
            if i < num_blocks:
                self.pool.cache_block(res.blocks[e], self._group_key(res.hashes[i], e % G),
                                      tuple(res.token_ids[i * bs:(i + 1) * bs]))
        self.pool.free_blocks(self._real(list(reversed(res.blocks[num_blocks * G:]))))
        del res.blocks[num_blocks * G:], res.hashes[num_blocks:], res.token_ids[num_blocks * bs:]
        res.fresh = [e for e in res.fresh if e < num_blocks * G]

    def release(self, res: KVReservation) -> None:
        """Drop the reservation's pins (tail first); committed blocks stay cached, evictable."""
        self.pool.free_blocks(self._real(list(reversed(res.blocks))))
        res.blocks.clear()

    # ---- allocation ---------------------------------------------------------------
    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after `req.num_computed_tokens`
        (plus `computed_blocks`, prefix hits taken now), first freeing the blocks behind its
        sliding windows. Returns the new entries' block ids, or None when there are not
        enough free blocks (nothing else is changed then)."""
        computed_blocks = computed_blocks or []
        self._free_dead(req)
        G = self.num_groups
        blocks = self.req_to_blocks.setdefault(req.request_id, [])
        total = req.num_computed_tokens + len(computed_blocks) // G * self.block_size + num_new_tokens
        need = max(cdiv(total, self.block_size) - (len(blocks) + len(computed_blocks)) // G, 0) * G
        # Hits that sit unowned in the LRU count as free now; touching them takes them.
        reusable = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - reusable:
            if not blocks:
                del self.req_to_blocks[req.request_id]
            return None
        self.pool.touch(self._real(computed_blocks))
        new_blocks = self.pool.get_new_blocks(need)
        blocks.extend(computed_blocks)
        blocks.extend(new_blocks)
        self._req_tokens[req.request_id] = total
        return [b.block_id for b in computed_blocks + new_blocks]

    # ---- host tier (swap) -----------------------------------------------------------
    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free)

    def num_cached_blocks(self, req: Request) -> int:
        """The request's logical blocks whose first group's block sits in the prefix index (they
        survive a recompute preemption)."""
        blocks = self.req_to_blocks.get(req.request_id, ())
        k = self._full_groups[0] if self._full_groups else 0
        return sum(1 for b in blocks[k::self.num_groups] if b.block_hash is not None)  # the null block never is

    def swap_out(self, req: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the host tier: (device, host) pairs to copy, or None
        when the host pool lacks room (nothing changed then)."""
        blocks = self.req_to_blocks.get(req.request_id, [])
        real = self._real(blocks)
        if not real or len(real) > len(self._host_free):
            return None
        host = [None if b is self.null_block else self._host_free.pop() for b in blocks]
        pairs = [(b.block_id, h) for b, h in zip(blocks, host) if h is not None]
        dead = self._req_dead.get(req.request_id, 0)
        self.free(req)
        self.req_to_host_blocks[req.request_id] = host
        self._req_dead[req.request_id] = dead
        return pairs

    def swap_in(self, req: Request, num_new_tokens: int) -> tuple[list[tuple[int, int]], list[int]] | None:
        """Bring a swapped request back with room for `num_new_tokens` more: (host, device)
        pairs to copy and all its device block ids, or None when device blocks are short."""
        host = self.req_to_host_blocks[req.request_id]
        G = self.num_groups
        total = req.num_computed_tokens + num_new_tokens
        more = max(cdiv(total, self.block_size) - len(host) // G, 0) * G
        if sum(h is not None for h in host) + more > self.pool.num_free_blocks:
            return None
        new = iter(self.pool.get_new_blocks(sum(h is not None for h in host) + more))
        blocks = [self.null_block if h is None else next(new) for h in host] + list(new)
        self.req_to_blocks[req.request_id] = blocks
        self._req_tokens[req.request_id] = total
        del self.req_to_host_blocks[req.request_id]
        self._host_pending.extend(h for h in host if h is not None)
        return [(h, b.block_id) for h, b in zip(host, blocks) if h is not None], [b.block_id for b in blocks]

    def release_pending_host_blocks(self) -> None:
        self._host_free.extend(self._host_pending)
        self._host_pending.clear()

    def free(self, req: Request) -> None:
        host = self.req_to_host_blocks.pop(req.request_id, None)
        if host:
            self._host_free.extend(h for h in host if h is not None)
        blocks = self.req_to_blocks.pop(req.request_id, None)
        self._req_hashes.pop(req.request_id, None)
        self._req_tokens.pop(req.request_id, None)
        self._req_dead.pop(req.request_id, None)
        if blocks:
            self.pool.free_blocks(self._real(list(reversed(blocks))))

    def block_ids(self, req: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req.request_id, ())]

    # ---- figures ------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks requests can hold (the null block aside)."""
        return self.pool.num_blocks - (self.null_block is not None)

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
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    @property
    def utilization(self) -> float:
        """Tokens stored / token capacity of the blocks owned: internal fragmentation (per
        group: an entry behind a sliding window counts as held)."""
        entries = sum(len(b) for b in self.req_to_blocks.values())
        if not entries:
            return 1.0
        return sum(self._req_tokens.values()) * self.num_groups / (entries * self.block_size)
