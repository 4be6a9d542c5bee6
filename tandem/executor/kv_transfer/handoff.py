"""P/D disaggregation, worker side: the KV bytes of the blocks the scheduler side
(core/kv_connector/pd.py) hands out. A prefill instance exports the KV of a prompt it has just
run (its whole blocks stay in the prefix cache). A decode instance reserves blocks for them
*before* the transfer (the request's KV quota), writes the layers into them as they land, and
indexes them in its prefix cache under the same chained hashes; the decode request (prompt +
first token) then finds them through the ordinary prefix lookup and recomputes only the tail,
less than one block. The blocks stay pinned until that request is admitted or gone, so nothing
evicts them in between."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, wait

import torch

from tandem.core.kv_cache_coordinator import flat_block_ids
from tandem.core.kv_connector.pd import KVPoolFullError, KVReservation, PDConnector
from tandem.executor.base import Executor
from tandem.executor.kv_transfer.base import LayerSink
from tandem.executor.kv_transfer.payload import KVPayload


class KVHandoff:
    """Engine methods run on the engine thread, between steps; `writer` may run anywhere."""

    def __init__(
        self,
        connector: PDConnector,
        executor: Executor,
        in_flight: Callable[[], list[Future]] = list,
    ) -> None:
        self.connector, self.executor = connector, executor
        self.block_size = connector.coordinator.block_size
        # Steps still running (async scheduling): a reserved block may have been freed by a
        # request whose last step is one of them and still writes it, so writes wait for them.
        self._in_flight = in_flight

    # ---- prefill side -------------------------------------------------------------
    def export(self, token_ids: list[int]) -> KVPayload:
        """A copy of the KV of the longest run of whole blocks of `token_ids` cached here. Call
        right after the request finished (prefill) or was aborted (a decode leg migrating),
        before a later step can evict its blocks. Waits for the steps in flight first: under
        async scheduling one may still write the last block the prefix cache indexed."""
        self._need_caching()
        wait(self._in_flight())
        blocks, n = self.connector.cached_prefix(token_ids)
        kv = self.executor.read_kv_blocks(flat_block_ids(blocks))
        return KVPayload(list(token_ids[: n * self.block_size]), self.block_size, kv)

    # ---- decode side --------------------------------------------------------------
    def reserve(self, token_ids: list[int]) -> KVReservation:
        """Hold blocks for the prompt's whole blocks before the transfer; raises KVPoolFullError
        (nothing held) when the pool is short."""
        self._need_caching()
        res = self.connector.reserve(token_ids)
        if res is None:
            raise KVPoolFullError(
                f"{len(token_ids) // self.block_size} KV blocks asked for, "
                f"{self.connector.coordinator.pool.num_free_blocks} free"
            )
        return res

    def writer(self, res: KVReservation) -> LayerSink:
        """`on_layer` for a transport's recv: places each layer as it lands. Take it after
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
        bs, n = self.block_size, min(payload.num_blocks, res.num_blocks)
        same = payload.block_size == bs and payload.token_ids[: n * bs] == res.token_ids[: n * bs]
        if not same or request_id in self.connector.pins:
            self.connector.release(res)
            raise ValueError(
                "the KV payload does not hold the reserved tokens, or "
                f"{request_id!r} already has some"
            )
        self.connector.commit(res, n)
        self.connector.pin(request_id, res)

    def release(self, res: KVReservation) -> None:
        """Give a reservation back (the transfer failed or timed out)."""
        self.connector.release(res)

    def _write(self, res: KVReservation, kv: torch.Tensor, layer: int | None) -> None:
        """The payload's blocks with one to write (PDConnector.fresh_block_ids)."""
        written, block_ids = self.connector.fresh_block_ids(res, kv.shape[-4])
        if len(written) < kv.shape[-4]:
            index = torch.tensor(written, dtype=torch.long, device=kv.device)
            kv = kv.index_select(kv.dim() - 4, index)
        # even with nothing fresh: the executor checks that the payload fits its cache
        self.executor.write_kv_blocks(block_ids, kv, layer)

    def _need_caching(self) -> None:
        if not self.connector.coordinator.enable_caching:
            raise ValueError(
                "KV transfer needs the prefix cache (enable_prefix_caching) on both sides"
            )
