"""P/D handoff in the router. `routing.route_pd` picks a prefill and a decode instance; the
prefill instance runs the prompt to its first token and ships its KV (shared memory, one
host); the decode instance continues from prompt + first token. The client sees one normal
OpenAI response: the first token from the prefill side, the rest from the decode side, one id.
Anything the split cannot serve exactly (no token ids, n > 1, logprobs) goes the plain way."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.cluster.proxy import Retry, json_error
from tandem.cluster.routing import route_pd

if TYPE_CHECKING:
    from tandem.cluster.router import Router

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens",
                 "include_stop_str_in_output", "priority")
ROOM_WAIT_S = 5.0  # how long a request waits for a decode instance with room for its KV


class PDHandoff:
    def __init__(self, router: Router) -> None:
        self.router = router

    def applies(self, model: str) -> bool:
        roles = {i.state.role for i in self.router.pool.group(model) if i.state.available}
        return {"prefill", "decode"} <= roles

    async def handle(self, model: str, path: str, body: dict, stream: bool, ids: list[int] | None,
                     hashes: list[int]) -> Response:
        r = self.router
        raw = json.dumps(body).encode()

        def plain():
            return r.proxy.forward(model, path, raw, stream, hashes, len(ids or ()), r.rcfg.max_attempts)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if not path.endswith("/chat/completions") and max_tokens is None:
            max_tokens = 16  # the completions API's default
        logprobs = body.get("logprobs")
        if not ids or body.get("n", 1) != 1 or (logprobs is not None and logprobs is not False) \
                or body.get("echo") or max_tokens == 1:
            return await plain()
        deadline = time.monotonic() + ROOM_WAIT_S
        while True:
            views = [i.view() for i in r.pool.group(model)]
            pre, dec = route_pd(views, len(ids), len(ids) + (max_tokens or 1), hashes, r.rcfg.weights)
            if dec is not None or time.monotonic() > deadline:
                break
            await asyncio.sleep(r.rcfg.poll_interval_s)
        if dec is None:
            r.metrics.failures.labels(model, "no_decode_room").inc()
            return json_error(503, f"model `{model}`: no decode instance has room for {len(ids) + (max_tokens or 1)} "
                                   "KV tokens; retry later")
        dec_inst = r.pool.instances[dec.instance_id]
        if pre is None:  # an idle decode instance prefills this short prompt itself
            out = await r.proxy.attempt(dec_inst, path, raw, stream, len(ids))
            return out if not isinstance(out, Retry) else await plain()
        pre_inst = r.pool.instances[pre.instance_id]
        tid, sampling = uuid.uuid4().hex, {k: body[k] for k in SAMPLING_KEYS if k in body}
        key = pre_inst.start(len(ids))
        r.metrics.routed.labels(model, pre_inst.id).inc()
        try:
            resp = await r.client.post(pre_inst.url + "/tandem/prefill",
                                       json={"prompt": ids, "transfer_id": tid, "sampling": sampling})
            first = resp.json() if resp.status_code == 200 else None
        except httpx.TransportError as e:
            r.pool.mark_failed(pre_inst, f"{type(e).__name__}: {e}")
            first = None
        finally:
            pre_inst.finish(key)
        if first is None:  # prefill instance gone or refused: serve it the plain way
            r.metrics.retries.labels(model, "prefill_failed").inc()
            return await plain()
        r.metrics.kv_bytes.labels(model).inc(first["kv_bytes"])
        r.metrics.kv_seconds.labels(model).observe(first["kv_seconds"])
        chat = path.endswith("/chat/completions")
        events = self._events(dec_inst, ids, first, sampling, max_tokens, tid)
        try:
            head = await events.__anext__()  # the decode leg is up (or the request already finished)
        except (httpx.HTTPError, StopAsyncIteration) as e:
            if isinstance(e, httpx.TransportError):
                r.pool.mark_failed(dec_inst, f"{type(e).__name__}: {e}")
            r.metrics.retries.labels(model, "decode_failed").inc()
            return await plain()
        fmt = _Format(model, chat, len(ids), body)
        if stream:
            return StreamingResponse(fmt.sse(head, events), media_type="text/event-stream",
                                     headers={"x-tandem-instance": f"{pre_inst.id}+{dec_inst.id}"})
        try:
            return JSONResponse(await fmt.body(head, events), headers={"x-tandem-instance": f"{pre_inst.id}+{dec_inst.id}"})
        except (httpx.HTTPError, RuntimeError) as e:
            r.metrics.failures.labels(model, "stream_broken").inc()
            return json_error(502, f"decode instance {dec_inst.id} failed mid-request: {type(e).__name__}: {e}")

    async def _events(self, dec, ids, first: dict, sampling: dict, max_tokens, tid: str) -> AsyncIterator[dict]:
        """Completion chunks: the prefill side's token once the decode leg is up, then the
        decode side's stream."""
        r = self.router
        # "length" is only the prefill leg's max_tokens=1; a stop (EOS, stop token or string) is final.
        finish = first["finish_reason"] if first["finish_reason"] != "length" else None
        head = {"text": first["text"], "finish_reason": finish}
        if finish is not None:
            yield head
            return
        key = dec.start(0)
        r.metrics.routed.labels(dec.model, dec.id).inc()
        body = {"prompt": ids + first["token_ids"], "transfer_id": tid,
                "sampling": {**sampling, "max_tokens": None if max_tokens is None else max_tokens - 1}}
        try:
            async with r.client.stream("POST", dec.url + "/tandem/decode", json=body) as resp:
                if resp.status_code != 200:
                    raise httpx.RemoteProtocolError(f"decode instance answered {resp.status_code}: "
                                                    f"{(await resp.aread())[:300]!r}")
                dec.first_token(key)
                yield head
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        yield json.loads(line[6:])
        finally:
            dec.finish(key)


class _Format:
    """Decode-side completion chunks -> the client's API (chat or completions), one id."""

    def __init__(self, model: str, chat: bool, prompt_tokens: int, body: dict) -> None:
        self.model, self.chat, self.prompt_tokens = model, chat, prompt_tokens
        self.rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.completion_tokens = 0

    def chunk(self, text: str, finish: str | None) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        choice = {"index": 0, "delta": {"content": text}} if self.chat else {"index": 0, "text": text}
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "choices": [{**choice, "logprobs": None, "finish_reason": finish}]}

    def usage_body(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    async def pieces(self, head: dict, events: AsyncIterator[dict]) -> AsyncIterator[tuple[str, str | None]]:
        """(text, finish_reason) per step; raises RuntimeError on a decode-side error."""
        self.completion_tokens = 1
        yield head["text"], head["finish_reason"]
        async for ev in events:
            if "error" in ev:
                raise RuntimeError(ev["error"].get("message", "decode instance error"))
            if ev.get("usage"):
                self.completion_tokens = 1 + ev["usage"]["completion_tokens"]
            for c in ev.get("choices") or ():
                yield c.get("text", ""), c.get("finish_reason")

    async def sse(self, head: dict, events: AsyncIterator[dict]) -> AsyncIterator[str]:
        if self.chat:
            role = self.chunk("", None)
            role["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield f"data: {json.dumps(role)}\n\n"
        try:
            async for text, finish in self.pieces(head, events):
                yield f"data: {json.dumps(self.chunk(text, finish))}\n\n"
            if self.usage:
                yield f"data: {json.dumps({**self.chunk('', None), 'choices': [], 'usage': self.usage_body()})}\n\n"
        except (httpx.HTTPError, RuntimeError) as e:
            msg = f"decode side failed mid-stream ({type(e).__name__}: {e}); the response is incomplete"
            yield f"data: {json.dumps({'error': {'message': msg, 'type': 'server_error', 'code': 502}})}\n\n"
        yield "data: [DONE]\n\n"

    async def body(self, head: dict, events: AsyncIterator[dict]) -> dict:
        text, finish = "", None
        async for piece, fin in self.pieces(head, events):
            text, finish = text + piece, fin or finish
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model,
                "choices": [{**choice, "logprobs": None, "finish_reason": finish}], "usage": self.usage_body()}
