"""The engine side of P/D disaggregation. A prefill instance exports the KV of a prompt it
has just run (its whole blocks stay in the prefix cache). A decode instance reserves blocks
for them *before* the transfer (the request's KV quota), writes the layers into them as they
land, and indexes them in its prefix cache under the same chained hashes; the decode request
(prompt + first token) then finds them through the ordinary prefix lookup and recomputes only
the tail, less than one block. The blocks stay pinned until that request is admitted or gone,
so nothing evicts them in between."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future, wait

import torch

from tandem.core.kv_cache_manager import KVCacheManager, KVPoolFullError, KVReservation
from tandem.core.request import Request, RequestStatus
from tandem.executor.base import Executor
from tandem.executor.kv_transfer.base import LayerSink
from tandem.executor.kv_transfer.payload import KVPayload


class KVHandoff:
    """Engine methods run on the engine thread, between steps; `writer` may run anywhere."""

    def __init__(self, kv_manager: KVCacheManager, executor: Executor,
                 in_flight: Callable[[], list[Future]] = list) -> None:
        self.kv, self.executor = kv_manager, executor
        # Steps still running (async scheduling): a reserved block may have been freed by a
        # request whose last step is one of them and still writes it, so writes wait for them.
        self._in_flight = in_flight
        self._pins: dict[str, KVReservation] = {}  # request id -> blocks held until it is admitted

    # ---- prefill side -------------------------------------------------------------
    def export(self, token_ids: list[int]) -> KVPayload:
        """A copy of the KV of the longest run of whole blocks of `token_ids` cached here. Call
        right after the request finished (prefill) or was aborted (a decode leg migrating),
        before a later step can evict its blocks. Waits for the steps in flight first: under
        async scheduling one may still write the last block the prefix cache indexed."""
        self._need_caching()
        wait(self._in_flight())
        blocks = self.kv.cached_prefix(token_ids)
        kv = self.executor.read_kv_blocks([b.block_id for b in blocks])
        num_tokens = len(blocks) // self.kv.num_groups * self.kv.block_size
        return KVPayload(list(token_ids[:num_tokens]), self.kv.block_size, kv)

    # ---- decode side --------------------------------------------------------------
    def reserve(self, token_ids: list[int]) -> KVReservation:
        """Hold blocks for the prompt's whole blocks before the transfer; raises KVPoolFullError
        (nothing held) when the pool is short."""
        self._need_caching()
        res = self.kv.reserve(token_ids)
        if res is None:
            raise KVPoolFullError(f"{len(token_ids) // self.kv.block_size} KV blocks asked for, "
                                  f"{self.kv.num_free_blocks} free")
        return res

    def writer(self, res: KVReservation) -> LayerSink:
        """`on_layer` for a connector's recv: places each layer as it lands. Take it after
        reserve; it fences on the steps in flight then (a superset of those that matter). The
        blocks are the reservation's alone until commit, so both may happen on any thread."""
        fence = self._in_flight()

        def write(layer: int, kv: torch.Tensor) -> None:
            wait(fence)
            self._write(res, kv, layer)
        return write

    def write(self, res: KVReservation, payload: KVPayload) -> None:
        """Place a whole payload received without `on_layer`."""
        wait(self._in_flight())
        self._write(res, payload.kv, None)

    def commit(self, res: KVReservation, payload: KVPayload, request_id: str) -> None:
        """After the transfer, with the decode request added: index the received blocks and
        keep them pinned until `request_id` is admitted or gone. Releases them and raises
        ValueError when the payload is not the KV of the reserved tokens (or the id is pinned)."""
        bs, n = self.kv.block_size, min(payload.num_blocks, len(res.blocks) // self.kv.num_groups)
        if payload.block_size != bs or payload.token_ids[:n * bs] != res.token_ids[:n * bs] or request_id in self._pins:
            self.kv.release(res)
            raise ValueError(f"the KV payload does not hold the reserved tokens, or {request_id!r} already has some")
        self.kv.commit(res, n)
        self._pins[request_id] = res

    def release(self, res: KVReservation) -> None:
        """Give a reservation back (the transfer failed or timed out)."""
        self.kv.release(res)

    def release_admitted(self, requests: Mapping[str, Request]) -> None:
        """Unpin for requests admitted (they hold their own references now) or gone; the
        engine calls this after each schedule() and abort."""
        for req_id in [r for r in self._pins if (q := requests.get(r)) is None or q.status != RequestStatus.WAITING]:
            self.kv.release(self._pins.pop(req_id))

    @property
    def num_pinned_blocks(self) -> int:
        """Logical blocks (of block_size tokens) held for decode requests not yet admitted."""
        return sum(len(res.blocks) for res in self._pins.values()) // self.kv.num_groups

    def _write(self, res: KVReservation, kv: torch.Tensor, layer: int | None) -> None:
        """The payload's logical blocks with a fresh entry; within one, a group's entry already
        cached here (or behind its window) takes the write into the null block, which is never
        read unmasked, so nothing cached is overwritten."""
        G, fresh = self.kv.num_groups, set(res.fresh)
        logical = sorted({e // G for e in fresh if e // G < kv.shape[-4]})
        if len(logical) < kv.shape[-4]:
            kv = kv.index_select(kv.dim() - 4, torch.tensor(logical, dtype=torch.long, device=kv.device))
        sink = self.kv.null_block
        # even with nothing fresh: the executor checks that the payload fits its cache
        self.executor.write_kv_blocks([res.blocks[e].block_id if e in fresh else sink.block_id
                                       for i in logical for e in range(i * G, (i + 1) * G)], kv, layer)

    def _need_caching(self) -> None:
        if not self.kv.enable_caching:
            raise ValueError("KV transfer needs the prefix cache (enable_prefix_caching) on both sides")
