"""The instance side of P/D disaggregation, over the engine's `kv_handoff` (export / reserve /
commit) and the instance's KV links (shared memory on one host; torch.distributed point-to-point
to a peer rank once POST /tandem/kv_group has joined the group).

POST /tandem/prefill runs a prompt to its first token, answers it, and sends the KV of its whole
blocks while the router starts the decode leg (a point-to-point send completes only once the
receiver takes it); POST /tandem/decode reserves blocks for that KV, receives it into them layer
by layer, adds the request (prompt + first token) and commits the blocks to its prefix cache, so
the request finds them by the ordinary prefix lookup and recomputes less than a block; it
answers with a completions-format SSE stream. A decode leg that fails before receiving still
drains its transfer. Handoff methods must run on the engine thread between steps:
`ClusterLLM.call` runs a function there."""
from __future__ import annotations

import asyncio
import json
import logging
import queue
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

from tandem.cluster.background import Background
from tandem.cluster.decode_stream import DecodeLegs, send_outcome
from tandem.engine.async_llm import AsyncLLM
from tandem.server.protocol import CompletionRequest
from tandem.server.responses import latency_split

log = logging.getLogger(__name__)
RECV_TIMEOUT_S = 30.0
NDJSON = "application/x-ndjson"


class ClusterLLM(AsyncLLM):
    """AsyncLLM that can also run `fn(engine)` on the engine thread, after the adds and aborts
    of a command drain and before the next step. A call queued after an add may run after a
    topped-up step has scheduled that request: what must come first goes in
    `generate(after_add=...)`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # before the loop thread starts
        super().__init__(*args, **kwargs)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._calls.put((fn, fut, loop))
        self._wake.set()
        return await fut

    def _drain_commands(self) -> None:
        super()._drain_commands()
        while True:
            try:
                fn, fut, loop = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                result, error = fn(self.engine), None
            except Exception as e:  # handed to the caller
                result, error = None, e
            loop.call_soon_threadsafe(_resolve, fut, result, error)


def _resolve(fut: asyncio.Future, result: Any, error: Exception | None) -> None:
    if not fut.done():
        fut.set_exception(error) if error is not None else fut.set_result(result)


class PrefillRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    prompt: list[int]
    transfer_id: str
    sampling: dict = {}
    kv_peer: int | None = None  # the other side's rank in the KV transfer group; None: shared memory


class DecodeRequest(PrefillRequest):
    stream_usage: bool = True
    request_id: str | None = None  # the router's id for this leg, for POST /tandem/migrate


class MigrateRequest(BaseModel):
    request_id: str
    transfer_id: str
    kv_peer: int | None = None


class KVGroupRequest(BaseModel):
    rank: int
    world_size: int
    host: str
    port: int
    backend: str | None = None
    timeout_s: float = 120.0


def _params(sampling: dict, prompt: list[int], max_tokens: int | None):
    try:
        req = CompletionRequest.model_validate({**sampling, "prompt": prompt, "max_tokens": max_tokens})
        return req.sampling_params(max_tokens, None), req.priority_level
    except ValueError as e:
        raise HTTPException(400, str(e)) from None


def add_pd_routes(app: FastAPI, llm: ClusterLLM, model_name: str) -> None:
    from tandem.executor.kv_transfer import KVLinks, KVPoolFullError
    links = KVLinks()
    spawn = Background().spawn
    legs = DecodeLegs(llm, links, model_name, spawn)

    async def drain(req: DecodeRequest) -> None:
        """A decode leg that will not take its transfer still receives it: the sender's
        point-to-point send (or its shm file) would otherwise be left waiting."""
        try:
            await links.recv(req.kv_peer, req.transfer_id, RECV_TIMEOUT_S)
        except Exception as e:  # nothing waits on this; the log says why
            log.warning("KV transfer %s not drained: %s", req.transfer_id, e)

    @app.post("/tandem/kv_group")
    async def kv_group(req: KVGroupRequest):
        device = llm.engine.executor.kv_device
        try:
            await asyncio.to_thread(links.join, req.rank, req.world_size, req.host, req.port, req.backend,
                                    req.timeout_s, device)
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        except (RuntimeError, TimeoutError) as e:  # the store is unreachable or a rank never came
            raise HTTPException(503, f"joining the KV transfer group failed: {e}") from None
        return {"rank": links.rank}

    @app.post("/tandem/prefill")
    async def prefill(req: PrefillRequest):
        """NDJSON: the first token, then (unless it already finished the request) the stats of
        the KV send, which starts now and completes once the decode side receives it."""
        params, priority = _params(req.sampling, req.prompt, 1)
        final = None
        try:
            async for out in llm.generate(req.prompt, params, f"prefill-{req.transfer_id}", priority):
                final = out
            o = final.outputs[0]
            head = {"token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason,
                    "cached_tokens": final.metrics.num_cached_tokens, "metrics": latency_split([final])}
            if o.finish_reason != "length":  # stopped at its first token: nothing to hand off
                return StreamingResponse(_ndjson(head), media_type=NDJSON)
            links.connector(req.kv_peer)  # a bad peer fails here, as a 400
            payload = await llm.call(lambda e: e.kv_handoff.export(req.prompt))
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        sending = spawn(links.send(req.kv_peer, req.transfer_id, payload))
        return StreamingResponse(_ndjson({**head, "kv_blocks": payload.num_blocks}, sending), media_type=NDJSON)

    @app.post("/tandem/decode")
    async def decode(req: DecodeRequest):
        kv_tokens = req.prompt[:-1]  # the prefill side's prompt; the last token is its first output
        try:
            params, priority = _params(req.sampling, req.prompt, req.sampling.get("max_tokens"))
            links.connector(req.kv_peer)
            res = await llm.call(lambda e: e.kv_handoff.reserve(kv_tokens))
        except (HTTPException, KVPoolFullError, ValueError) as e:
            spawn(drain(req))
            if isinstance(e, HTTPException):
                raise
            raise HTTPException(503 if isinstance(e, KVPoolFullError) else 400, str(e)) from None
        handoff = llm.engine.kv_handoff
        try:
            payload, _ = await links.recv(req.kv_peer, req.transfer_id, RECV_TIMEOUT_S, handoff.writer(res))
        except Exception as e:  # timed out, peer gone, or a payload that does not fit: nothing is kept
            await llm.call(lambda e_: e_.kv_handoff.release(res))
            raise HTTPException(502, f"KV transfer {req.transfer_id} failed: {type(e).__name__}: {e}") from None
        rid = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        # The commit runs with the add, before a step can schedule the request. Not the reserved
        # tokens (or a reused id): released, and the request recomputes its prompt.
        gen = llm.generate(req.prompt, params, rid, priority,
                           after_add=lambda e: e.kv_handoff.commit(res, payload, rid))
        return StreamingResponse(legs.stream(gen, rid, req.prompt, req.stream_usage), media_type="text/event-stream")

    @app.post("/tandem/migrate")
    async def migrate(req: MigrateRequest):
        """Move a streaming decode leg: its stream ends with the tokens so far, its KV goes to
        `kv_peer` under `transfer_id`, where the router continues it."""
        try:
            moving = legs.migrate(req.request_id, req.transfer_id, req.kv_peer)
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        if not moving:
            raise HTTPException(404, f"no decode leg {req.request_id!r} is streaming here")
        return {"request_id": req.request_id, "migrating": True}


async def _ndjson(head: dict, sending: asyncio.Future | None = None):
    yield json.dumps(head) + "\n"
    if sending is not None:
        yield json.dumps(await send_outcome(sending)) + "\n"
