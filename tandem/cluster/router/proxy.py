"""One request's trip to an instance, with retries: a failure before the first token (refused
connection, instance gone, 429/502/503) moves the request to another instance, since the client
has seen nothing yet; a failure after it ends the client's stream with an error event. A
stream's response is held back until its first token, so a request queued on an instance
that dies is retried, not lost."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from fastapi.responses import Response, StreamingResponse

from tandem.cluster.router.metrics import RouterMetrics
from tandem.cluster.router.pool import Instance, InstancePool
from tandem.server import responses as R

RETRY_STATUS = (429, 502, 503)  # overloaded or engine down: another instance may serve it


@dataclass(slots=True)
class Retry:
    reason: str  # connect | disconnect | status
    message: str
    response: Response | None = None  # the instance's own answer, returned if every try ends so


def error_body(status: int, message: str, type_: str = "server_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": status}}


def is_progress(line: str) -> bool:
    """A stream line carrying a token, a finish, an error or the end: past the point of retry."""
    if not line.startswith("data:"):
        return False
    data = line[5:].strip()
    if data == "[DONE]":
        return True
    try:
        chunk = json.loads(data)
    except ValueError:
        return True
    if "error" in chunk:
        return True
    for c in chunk.get("choices") or ():
        delta = c.get("delta")  # chat; a completion chunk is one generation step
        if delta is None or delta.get("content") or c.get("finish_reason") or "role" not in delta:
            return True
    return False


class Proxy:
    def __init__(
        self, pool: InstancePool, client: httpx.AsyncClient, metrics: RouterMetrics
    ) -> None:
        self.pool, self.client, self.metrics = pool, client, metrics

    async def attempt(
        self,
        inst: Instance,
        path: str,
        body: bytes,
        stream: bool,
        prompt_tokens: int,
        head_out: list[str] | None = None,
    ) -> Response | Retry:
        """Send to `inst`. For a stream, `head_out` (if given) receives the lines up to the first
        token instead of a response being built (the P/D prefill leg reads them itself)."""
        key = inst.start(prompt_tokens)
        self.metrics.routed.labels(inst.model, inst.id).inc()
        headers = {"content-type": "application/json", "x-tandem-instance": inst.id}
        try:
            resp = await self.client.send(
                self.client.build_request(
                    "POST",
                    inst.url + path,
                    content=body,
                    headers={"content-type": "application/json"},
                ),
                stream=True,
            )
        except httpx.TransportError as e:
            inst.finish(key)
            self.pool.mark_failed(inst, f"{type(e).__name__}: {e}")
            return Retry("connect", f"instance {inst.id}: {type(e).__name__}: {e}")
        handed_over = False
        try:
            if not stream or resp.status_code != 200:
                content = await resp.aread()
                out = Response(
                    content,
                    resp.status_code,
                    headers=headers,
                    media_type=resp.headers.get("content-type"),
                )
                if resp.status_code in RETRY_STATUS:
                    return Retry("status", f"instance {inst.id} answered {resp.status_code}", out)
                return out
            lines = resp.aiter_lines()
            head = []
            async for line in lines:
                head.append(line + "\n")
                if is_progress(line):
                    break
            else:
                raise httpx.RemoteProtocolError("stream ended before its first token")
            inst.first_token(key)
            if head_out is not None:
                head_out.extend(head)
                return Response(status_code=200)
            handed_over = True
            return StreamingResponse(
                self.relay(inst, key, resp, head, lines),
                media_type="text/event-stream",
                headers={"x-tandem-instance": inst.id},
            )
        except httpx.TransportError as e:
            self.pool.mark_failed(inst, f"{type(e).__name__}: {e}")
            return Retry(
                "disconnect",
                f"instance {inst.id} failed before the first token: {type(e).__name__}: {e}",
            )
        finally:
            if not handed_over:
                await resp.aclose()
                inst.finish(key)

    async def relay(
        self,
        inst: Instance,
        key: int,
        resp: httpx.Response,
        head: list[str],
        lines: AsyncIterator[str],
    ) -> AsyncIterator[str]:
        """Pass the stream through unchanged; end it with an error event if the instance fails."""
        done = any(line.startswith("data: [DONE]") for line in head)
        try:
            for line in head:
                yield line
            async for line in lines:
                done = done or line.startswith("data: [DONE]")
                yield line + "\n"
            if not done:
                raise httpx.RemoteProtocolError("the instance closed the stream before it finished")
        except httpx.HTTPError as e:
            self.pool.mark_failed(inst, f"{type(e).__name__}: {e}")
            self.metrics.failures.labels(inst.model, "stream_broken").inc()
            yield R.error_event(
                f"instance {inst.id} failed mid-stream ({type(e).__name__}: {e}); "
                "the response is incomplete",
                502,
            )
            yield R.SSE_DONE
        finally:
            await resp.aclose()
            inst.finish(key)

    async def forward(
        self,
        model: str,
        path: str,
        body: bytes,
        stream: bool,
        prefix_hashes: list[int],
        prompt_tokens: int,
        max_attempts: int,
        role: str | None = None,
        lora: str | None = None,
    ) -> Response:
        """Route, send, retry on another instance; 503 with the reason when none can serve.
        `lora`: only to instances serving that adapter."""
        tried: set[str] = set()
        last: Retry | None = None
        for _ in range(max_attempts):
            inst = self.pool.choose(model, prefix_hashes, role, exclude=tried, lora=lora)
            if inst is None:
                break
            tried.add(inst.id)
            out = await self.attempt(inst, path, body, stream, prompt_tokens)
            if not isinstance(out, Retry):
                return out
            last = out
            self.metrics.retries.labels(model, out.reason).inc()
        if last is None:
            self.metrics.failures.labels(model, "no_instance").inc()
            return json_error(503, self.pool.unavailable_reason(model))
        self.metrics.failures.labels(model, "all_failed").inc()
        if last.response is not None:
            return last.response
        return json_error(
            503,
            f"model `{model}`: every instance tried failed ({', '.join(sorted(tried))}); "
            f"last error: {last.message}",
        )


def json_error(status: int, message: str, type_: str | None = None) -> Response:
    type_ = type_ or (
        "not_found_error"
        if status == 404
        else "server_error"
        if status >= 500
        else "invalid_request_error"
    )
    return Response(
        json.dumps(error_body(status, message, type_)), status, media_type="application/json"
    )
