"""The engine-core side of P/D disaggregation: the utilities the instance's P/D routes send
(`AsyncLLM.call_utility` with the messages of `core_messages.py`, answered by the methods
`utilities()` maps them to) and the commit that runs with a decode request's add (`on_add`).
The KV pool and the KV links live here, in the engine process, so no KV crosses to the API
process. Every method runs on the engine thread between two steps; transfers run on the
links' threads, and a method that waits for a peer returns a `Future` so the step loop goes on.
Results are plain dicts and ints (they cross the process boundary as msgpack).

A transfer is named by the id the router gives both legs. Prefill side: `send_kv` exports the
prompt's whole blocks and starts the send, `kv_sent` waits for its outcome. Decode side:
`receive_kv` reserves blocks and receives into them, then the decode request is added with
`kv_transfer={"transfer_id": ...}` and `on_add` indexes the blocks for it; `release_kv` gives
them back when that add will not come, `drain_kv` takes a transfer off the link for a leg
refused before it reserved. `migrate_out` moves a decoding request's KV away."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tandem.core.kv_connector.pd import KVReservation
from tandem.engine.core_messages import (
    CheckKVPeer,
    DrainKV,
    JoinKVGroup,
    KVSent,
    MigrateOut,
    ReceiveKV,
    ReleaseKV,
    SendKV,
)
from tandem.executor.kv_transfer import KVLinks, KVPayload, TransferStats

log = logging.getLogger(__name__)
RECV_TIMEOUT_S = 30.0  # a decode leg's wait for its transfer to start
CLAIM_S = 60.0  # received KV not claimed by an add (or released) within this is released
SENT_KEEP_S = 300.0  # a send's outcome is kept this long for `kv_sent`


@dataclass(slots=True)
class _Receipt:
    res: KVReservation
    recv: Future  # of (KVPayload, TransferStats)
    done_at: float | None = None  # when the receive ended
    abandoned: bool = False  # released while still receiving: given back once the receive ends


class PDService:
    """Registered with the engine core (`EngineCore.register_utilities(svc.utilities(),
    svc.on_add)`); `core` gives the KV handoff, the executor (its KV device) and `abort_request`."""

    def __init__(self, core: Any, links: KVLinks | None = None) -> None:
        self.core, self.handoff = core, core.kv_handoff
        self.links = links or KVLinks()
        self._sends: dict[str, tuple[float, Future]] = {}  # transfer id -> (start time, send)
        self._receipts: dict[str, _Receipt] = {}  # transfer id -> blocks reserved for it

    def utilities(self) -> dict[type, Callable[..., Any]]:
        """The utility messages this service answers, and the method that answers each."""
        return {
            JoinKVGroup: self.join_kv_group,
            CheckKVPeer: self.check_kv_peer,
            SendKV: self.send_kv,
            MigrateOut: self.migrate_out,
            KVSent: self.kv_sent,
            ReceiveKV: self.receive_kv,
            ReleaseKV: self.release_kv,
            DrainKV: self.drain_kv,
        }

    # ---- the group ----------------------------------------------------------------
    def join_kv_group(
        self,
        rank: int,
        world_size: int,
        host: str,
        port: int,
        backend: str | None = None,
        timeout_s: float = 120.0,
    ) -> Future:
        """Join the torch.distributed group of the cluster (POST /tandem/kv_group); resolves to
        this instance's rank once every rank has joined. ValueError for a bad rank or backend,
        RuntimeError / TimeoutError when the store or a rank never answers."""
        device = self.core.executor.kv_device
        return _then(
            self.links.pool.submit(
                self.links.join, rank, world_size, host, port, backend, timeout_s, device
            ),
            lambda _: self.links.rank,
        )

    # ---- prefill side -------------------------------------------------------------
    def send_kv(self, token_ids: list[int], transfer_id: str, peer: int | None) -> int:
        """Export the KV of the prompt's whole blocks (call right after its request finished)
        and start sending it to `peer` (None: shared memory); returns the number of blocks."""
        self.links.transport(peer)  # a bad peer fails before the export
        return self._send(self.handoff.export(token_ids), transfer_id, peer)

    def migrate_out(
        self, request_id: str, token_ids: list[int], transfer_id: str, peer: int | None
    ) -> int:
        """Abort a decoding request and send the KV of `token_ids` (its prompt + the tokens its
        client has) to `peer`, in one engine-thread call, so no step runs between the request
        freeing its blocks and their export (one could evict them). Returns the blocks sent."""
        self.links.transport(peer)  # a bad peer fails before the request is touched
        self.core.abort_request(request_id)
        return self._send(self.handoff.export(token_ids), transfer_id, peer)

    def check_kv_peer(self, peer: int | None) -> None:
        """ValueError unless this instance has a KV link to `peer` (None: shared memory)."""
        self.links.transport(peer)

    def kv_sent(self, transfer_id: str) -> Future:
        """The outcome of a send started here, once the receiver has it: {kv_bytes, kv_seconds},
        or {error} when the peer went away or the link broke."""
        started = self._sends.pop(transfer_id, None)
        if started is None:
            raise ValueError(f"no KV send {transfer_id!r} here")
        return _then(started[1], _sent_outcome)

    def _send(self, payload: KVPayload, transfer_id: str, peer: int | None) -> int:
        now = time.monotonic()
        for tid in [t for t, (at, f) in self._sends.items() if f.done() and now - at > SENT_KEEP_S]:
            del self._sends[tid]  # outcomes no one asked for
        if transfer_id in self._sends:
            raise ValueError(f"KV transfer {transfer_id!r} is already being sent")
        self._sends[transfer_id] = (now, self.links.send(peer, transfer_id, payload))
        return payload.num_blocks

    # ---- decode side --------------------------------------------------------------
    def receive_kv(self, token_ids: list[int], transfer_id: str, peer: int | None) -> Future:
        """Reserve blocks for the whole blocks of `token_ids` (the prefill side's prompt) and
        receive the transfer into them, layer by layer. Raises KVPoolFullError (nothing held)
        when the pool is short, ValueError for a bad peer; resolves to {kv_blocks, kv_bytes,
        kv_seconds}, or {error} (then `release_kv`)."""
        self._expire()
        self.links.transport(peer)
        if transfer_id in self._receipts:
            raise ValueError(f"KV transfer {transfer_id!r} is already being received")
        res = self.handoff.reserve(token_ids)
        try:
            recv = self.links.recv(peer, transfer_id, RECV_TIMEOUT_S, self.handoff.writer(res))
        except BaseException:
            self.handoff.release(res)
            raise
        receipt = self._receipts[transfer_id] = _Receipt(res, recv)
        recv.add_done_callback(lambda _: setattr(receipt, "done_at", time.monotonic()))
        return _then(recv, _received_outcome)

    def release_kv(self, transfer_id: str) -> None:
        """Give back the blocks held for a transfer whose decode request will not be added
        (the receive failed, or the leg ended first). A no-op once `on_add` took them. While
        the receive still writes into them they stay held, and go once it has ended."""
        receipt = self._receipts.get(transfer_id)
        if receipt is None:
            return
        if receipt.recv.done():
            del self._receipts[transfer_id]
            self.handoff.release(receipt.res)
        else:
            receipt.abandoned = True

    def drain_kv(self, transfer_id: str, peer: int | None) -> None:
        """A decode leg that will not take its transfer still receives it: the sender's
        point-to-point send (or its shm file) would otherwise be left waiting. Returns at once."""

        def logged(f: Future) -> None:
            if f.exception() is not None:  # nothing waits on this; the log says why
                log.warning("KV transfer %s not drained: %s", transfer_id, f.exception())

        try:
            self.links.recv(peer, transfer_id, RECV_TIMEOUT_S).add_done_callback(logged)
        except ValueError as e:  # no link to that peer: nothing can be waiting on it either
            log.warning("KV transfer %s not drained: %s", transfer_id, e)

    def on_add(self, request_id: str, kv_transfer: dict, accepted: bool) -> None:
        """With the decode request's add, before a step can schedule it: index the received
        blocks in the prefix cache and pin them until the request is admitted or gone, so it
        finds them by the ordinary prefix lookup. A refused add, a failed receive or KV that is
        not the request's prompt releases them (the request, if any, recomputes its prompt)."""
        self._expire()
        transfer_id = kv_transfer.get("transfer_id") if isinstance(kv_transfer, dict) else None
        receipt = self._receipts.get(transfer_id)
        if receipt is None:
            log.warning(
                "request %s names KV transfer %r, which is not held here", request_id, transfer_id
            )
            return
        recv = receipt.recv
        if not accepted or not recv.done() or recv.exception() is not None:
            self.release_kv(transfer_id)
            return
        del self._receipts[transfer_id]
        try:
            self.handoff.commit(receipt.res, recv.result()[0], request_id)
        except ValueError as e:  # commit released the blocks
            log.warning("KV transfer %s not used by %s: %s", transfer_id, request_id, e)

    def num_held_blocks(self) -> int:
        """Blocks (of block_size tokens) reserved for transfers not yet claimed by an add."""
        return sum(r.res.num_blocks for r in self._receipts.values())

    def _expire(self) -> None:
        now = time.monotonic()
        for tid, r in list(self._receipts.items()):
            if r.done_at is not None and (r.abandoned or now - r.done_at > CLAIM_S):
                if not r.abandoned:
                    log.warning(
                        "KV transfer %s received but not claimed in %.0f s: released", tid, CLAIM_S
                    )
                self.release_kv(tid)


def _then(fut: Future, fn: Callable[[Future], Any]) -> Future:
    """A future of `fn(fut)` once `fut` is done."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(fn(f))
        except Exception as e:  # handed to whoever waits on `out`
            out.set_exception(e)

    fut.add_done_callback(done)
    return out


def _sent_outcome(f: Future) -> dict:
    if f.exception() is not None:  # the peer went away or the link broke; its receive times out
        e = f.exception()
        return {"error": f"KV send failed: {type(e).__name__}: {e}"}
    stats: TransferStats = f.result()
    return {"kv_bytes": stats.num_bytes, "kv_seconds": stats.seconds}


def _received_outcome(f: Future) -> dict:
    if f.exception() is not None:  # timed out, peer gone, or a payload that does not fit
        e = f.exception()
        return {"error": f"{type(e).__name__}: {e}"}
    payload, stats = f.result()
    return {
        "kv_blocks": payload.num_blocks,
        "kv_bytes": stats.num_bytes,
        "kv_seconds": stats.seconds,
    }
