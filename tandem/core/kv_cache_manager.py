"""What the scheduler asks of the KV cache: the prefix-cache hit of a request (and its figures), a
request's blocks allocated, indexed and freed, and the pool's usage. The blocks are kept per KV
group by the coordinator (kv_cache_coordinator.py); swapped-out requests' blocks by the host tier
(kv_connector/host_tier.py)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from tandem.core.kv_cache_coordinator import KVCacheCoordinator, PerGroup
from tandem.core.kv_connector.host_tier import HostTierConnector
from tandem.core.request import Request


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
        self.block_size, self.group_windows = block_size, group_windows
        self.coordinator = KVCacheCoordinator(
            num_blocks, block_size, group_windows, enable_caching, max_prefix_tokens
        )
        self.pool = self.coordinator.pool
        self.host_tier = HostTierConnector(self.coordinator, num_host_blocks)
        self.min_match_length = min_match_length
        self.stats = PrefixCacheStats()

    # ---- prefix cache -------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[PerGroup, int]:
        """Longest cached prefix of the request's tokens, in whole blocks: each KV group's blocks,
        and the tokens they hold. At least one token is always left to compute, so the step
        still produces logits. No hit for a request that asks for prompt logprobs: every
        prompt position must run for its logits."""
        c = self.coordinator
        if not c.enable_caching or req.sampling_params.prompt_logprobs is not None:
            return (), 0
        num_blocks = c.prefix_limit(req.num_tokens - 1) // self.block_size
        hashes = c.request_block_hashes(req, num_blocks)
        blocks, n = c.find_longest_cache_hit(
            req.all_token_ids, itertools.islice(hashes, num_blocks)
        )
        num_hit = n * self.block_size
        if num_hit < max(self.min_match_length, 1):
            return (), 0
        return blocks, num_hit

    def record_prefix_query(self, req: Request, num_hit: int) -> None:
        """Count a request once, when it is first admitted."""
        if self.coordinator.enable_caching:
            self.stats.requests += 1
            self.stats.queries += req.num_prompt_tokens
            self.stats.hits += num_hit
            self.stats.requests_hit += num_hit > 0

    def cache_blocks(self, req: Request) -> None:
        """Index the request's full blocks whose KV is computed (call after the step ran)."""
        self.coordinator.cache_blocks(req)

    # ---- allocation ---------------------------------------------------------------
    def blocks_needed(self, req: Request, num_new: int, computed_blocks: PerGroup = ()) -> int:
        """Free blocks that room for `num_new` more tokens takes. For a swapped request the host
        tier's `swap_in` takes them, else `allocate_slots`. KVCacheCoordinator.blocks_needed
        says what counts."""
        if req.request_id in self.host_tier.req_to_host_blocks:
            return self.host_tier.blocks_needed(req, num_new)
        return self.coordinator.blocks_needed(req, num_new, computed_blocks)

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed_blocks: PerGroup = ()
    ) -> list[int] | None:
        """Room for `num_new_tokens` more tokens (plus `computed_blocks`, prefix hits taken
        now): the new blocks' ids, or None when free blocks are short (nothing changes then)."""
        return self.coordinator.allocate(req, num_new_tokens, computed_blocks)

    def token_room(self, req: Request, free_blocks: int) -> int:
        return self.coordinator.token_room(req, free_blocks)

    def token_capacity(self, max_chunk: int) -> int:
        return self.coordinator.token_capacity(max_chunk)

    def num_cached_blocks(self, req: Request) -> int:
        return self.coordinator.num_cached_blocks(req)

    def free(self, req: Request) -> None:
        """Give back everything the request holds, on the device and in the host tier."""
        self.coordinator.free(req.request_id)
        self.host_tier.request_finished(req.request_id)

    def block_ids(self, req: Request) -> list[int]:
        return self.coordinator.block_ids(req.request_id)

    # ---- figures ------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks requests can hold (the null block aside)."""
        return self.coordinator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def newest_cached_hashes(self, limit: int) -> list[int]:
        """The hashes of up to `limit` cached blocks, newest first (the pool keeps caching
        order)."""
        # A dict's keys are reversible; typeshed's KeysView does not say so.
        hashes = reversed(self.pool.cached_hashes)  # type: ignore[call-overload]
        return list(itertools.islice(hashes, limit))

    @property
    def usage(self) -> float:
        """Share of blocks owned by requests (cached-but-unowned blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    @property
    def utilization(self) -> float:
        return self.coordinator.utilization
