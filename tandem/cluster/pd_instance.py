"""The instance side of P/D disaggregation, over the engine's `kv_handoff` (export / reserve /
commit) and the shared-memory connector (both instances on one host).

POST /tandem/prefill runs a prompt to its first token, exports the KV of its whole blocks and
sends it; POST /tandem/decode reserves blocks for that KV, receives it into them layer by
layer, adds the request (prompt + first token) and commits the blocks to its prefix cache, so
the request finds them by the ordinary prefix lookup and recomputes less than a block; it
answers with a completions-format SSE stream. Handoff methods must run on the engine thread
between steps: `ClusterLLM.call` runs a function there."""
from __future__ import annotations

import asyncio
import json
import queue
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

from tandem.engine.async_llm import AsyncLLM
from tandem.server import responses as R
from tandem.server.protocol import CompletionRequest

RECV_TIMEOUT_S = 30.0


class ClusterLLM(AsyncLLM):
    """AsyncLLM that can also run `fn(engine)` on the engine thread, after the adds and aborts
    of a command drain and before the next step (so a commit queued right after a request's
    add lands before that request is scheduled)."""

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


class DecodeRequest(PrefillRequest):
    stream_usage: bool = True


def _params(sampling: dict, prompt: list[int], max_tokens: int | None):
    try:
        req = CompletionRequest.model_validate({**sampling, "prompt": prompt, "max_tokens": max_tokens})
        return req.sampling_params(max_tokens, None), req.priority_level
    except ValueError as e:
        raise HTTPException(400, str(e)) from None


def add_pd_routes(app: FastAPI, llm: ClusterLLM, model_name: str) -> None:
    from tandem.executor.kv_transfer import KVPoolFullError, ShmConnector
    connector = ShmConnector()

    @app.post("/tandem/prefill")
    async def prefill(req: PrefillRequest):
        params, priority = _params(req.sampling, req.prompt, 1)
        final = None
        try:
            async for out in llm.generate(req.prompt, params, f"prefill-{req.transfer_id}", priority):
                final = out
            payload = await llm.call(lambda e: e.kv_handoff.export(req.prompt))
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        stats = await asyncio.to_thread(connector.send, req.transfer_id, payload)
        o = final.outputs[0]
        return {"token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason,
                "cached_tokens": final.metrics.num_cached_tokens, "kv_blocks": payload.num_blocks,
                "kv_bytes": stats.num_bytes, "kv_seconds": stats.seconds}

    @app.post("/tandem/decode")
    async def decode(req: DecodeRequest):
        params, priority = _params(req.sampling, req.prompt, req.sampling.get("max_tokens"))
        kv_tokens = req.prompt[:-1]  # the prefill side's prompt; the last token is its first output
        try:
            res = await llm.call(lambda e: e.kv_handoff.reserve(kv_tokens))
        except KVPoolFullError as e:
            connector.discard(req.transfer_id)
            raise HTTPException(503, str(e)) from None
        handoff = llm.engine.kv_handoff
        try:
            payload, _ = await asyncio.to_thread(connector.recv, req.transfer_id, RECV_TIMEOUT_S, handoff.writer(res))
        except (TimeoutError, RuntimeError, ValueError) as e:
            await llm.call(lambda e_: e_.kv_handoff.release(res))
            raise HTTPException(502, f"KV transfer {req.transfer_id} failed: {e}") from None
        rid = f"cmpl-{uuid.uuid4().hex}"
        gen = llm.generate(req.prompt, params, rid, priority)  # queued now; the commit follows it
        try:
            await llm.call(lambda e: e.kv_handoff.commit(res, payload, rid))
        except ValueError:
            pass  # not the reserved tokens: released; the request recomputes its prompt
        return StreamingResponse(_sse(gen, rid, model_name, llm.tokenizer, req.stream_usage),
                                 media_type="text/event-stream")


async def _sse(gen, rid: str, model: str, tokenizer, usage: bool):
    created, final, finish_sent = int(time.time()), None, set()
    try:
        async for out in gen:
            final = out
            chunk = R.completion_chunk(rid, model, created, 0, 1, out, finish_sent, False, tokenizer)
            if chunk:
                yield f"data: {json.dumps(chunk)}\n\n"
        if usage:
            yield f"data: {json.dumps({'id': rid, 'choices': [], 'usage': R.usage([final])})}\n\n"
    except (ValueError, RuntimeError) as e:
        yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error', 'code': 500}})}\n\n"
    yield "data: [DONE]\n\n"
