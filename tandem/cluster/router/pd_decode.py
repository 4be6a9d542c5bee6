"""The decode side of a P/D request in the router: a chain of decode legs. The first continues
from the prefill side's first token; a migration (POST /tandem/migrate on the router, by the
response's id, or `migrate_loop.py` when a decode instance runs short of KV) ends the leg on
one decode instance, which sends the request's KV to another, and the next leg continues
there from exactly the tokens streamed so far. The client's stream goes on with no token
twice and none missing; greedy output is that of an unmoved run. A leg that fails (its
instance refuses it, dies or drops the stream) is resumed the same way on another decode
instance, which computes the KV of the tokens so far itself."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import httpx
from fastapi.responses import JSONResponse, Response

from tandem.cluster.policy.routing import choose_decode
from tandem.cluster.router.background import Background
from tandem.cluster.router.metrics import RouterMetrics
from tandem.cluster.router.pool import Instance, InstancePool
from tandem.cluster.router.proxy import json_error

log = logging.getLogger(__name__)


@dataclass(slots=True)
class DecodeLeg:
    """A P/D request while it decodes: where, under which id there, how much KV it holds, and
    where a migration asked for takes it next (`move_to` is set until the next leg is up)."""

    id: str  # the client's response id
    model: str
    dec: Instance
    kv_tokens: int  # prompt + max_tokens: the room a new home must have
    num_tokens: int = 0  # prompt + tokens out so far: the KV it holds
    n: int = 0  # legs before this one
    move_to: Instance | None = None
    move_reason: str = ""  # operator | kv_short
    transfer_id: str = ""

    @property
    def instance_rid(self) -> str:
        return f"{self.id}-{self.n}"


@dataclass(slots=True)
class _LegRun:
    """How one decode leg went: the tokens it streamed and why it ended (finished, moved,
    failed)."""

    key: int  # the instance's busy mark
    head: dict | None  # the prefill side's token, until a leg is up to follow it
    got: list[int] = field(default_factory=list)
    moved: dict | None = None  # the migrate event, when the leg ended by moving
    failure: str | None = None
    finished: bool = False
    resp: httpx.Response | None = None
    lines: AsyncIterator[str] | None = None


def leg_sampling(sampling: dict, max_tokens: int | None, done: int) -> dict:
    """A leg's sampling options once `done` tokens of the request are out."""
    out = {**sampling, "max_tokens": None if max_tokens is None else max_tokens - done}
    if "min_tokens" in sampling:
        out["min_tokens"] = max(0, (sampling["min_tokens"] or 0) - done)
    return out


async def kv_sent(
    metrics: RouterMetrics,
    inst: Instance,
    key: int,
    resp: httpx.Response,
    lines: AsyncIterator[str],
) -> None:
    """A sender's last line (NDJSON, or SSE `data:`): the KV send's bytes and seconds, or why
    it failed. `inst` counts as busy until then, so a drain for a role switch waits for it."""
    try:
        async for line in lines:
            if line.strip() and line != "data: [DONE]":
                out = json.loads(line.removeprefix("data: "))
                break
        else:
            raise ValueError("the sender closed before reporting its KV send")
        if "error" in out:
            raise ValueError(out["error"])
        metrics.kv_bytes.labels(inst.model).inc(out["kv_bytes"])
        metrics.kv_seconds.labels(inst.model).observe(out["kv_seconds"])
    except (httpx.HTTPError, ValueError, KeyError) as e:
        metrics.failures.labels(inst.model, "kv_send").inc()
        log.warning("KV send from %s failed: %s: %s", inst.id, type(e).__name__, e)
    finally:
        await resp.aclose()
        inst.finish(key)


class LegFailed(RuntimeError):
    """A decode leg ended without finishing its request: refused, gone, or its stream broken."""


async def leg_events(lines: AsyncIterator[str]) -> AsyncIterator[dict]:
    """A decode leg's events up to its [DONE]; LegFailed for an error event, a line that does not
    parse, or a stream that closes before [DONE] (a connection dropped mid-stream)."""
    async for line in lines:
        if line == "data: [DONE]":
            return
        if not line.startswith("data: "):
            continue
        try:
            ev = json.loads(line[6:])
        except ValueError:
            raise LegFailed(f"sent a line that does not parse: {line[:100]!r}") from None
        if "error" in ev:
            raise LegFailed(str(ev["error"].get("message", ev["error"])))
        yield ev
    raise LegFailed("closed the stream before it finished")


class DecodeChain:
    def __init__(
        self,
        pool: InstancePool,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        max_attempts: int,
    ) -> None:
        self.pool, self.client, self.metrics = pool, client, metrics
        self.max_attempts = max_attempts  # decode instances a request's legs may fail on
        self.live: dict[str, DecodeLeg] = {}  # by response id
        self.background = Background()

    async def events(
        self,
        leg: DecodeLeg,
        src: Instance,
        tokens: list[int],
        head: dict,
        sampling: dict,
        max_tokens: int | None,
        tid: str | None,
    ) -> AsyncIterator[dict]:
        """`head` (the prefill side's token) once the first leg is up, then the decode legs'
        completion chunks. A leg that fails (refused, its instance gone, its stream broken)
        before the request's finish is resumed on another decode instance from the tokens the
        client has, which computes their KV itself (`tid` None). Raises LegFailed (before `head`
        if no leg could start) when no other decode instance can take it."""
        # "length" is only the prefill leg's max_tokens=1; a stop (EOS, stop token or string) is
        # final.
        head = {
            **head,
            "finish_reason": None if head["finish_reason"] == "length" else head["finish_reason"],
        }
        if head["finish_reason"] is not None:
            yield head
            return
        done = len(head["token_ids"])  # tokens out so far: the prefill side's
        failed: list[str] = []  # the decode instances a leg of this request failed on
        self.live[leg.id] = leg
        try:
            while True:
                dec = leg.dec
                run = _LegRun(dec.start(0), head)
                body = {
                    "prompt": tokens,
                    "transfer_id": tid,
                    "kv_peer": src.kv_rank,
                    "request_id": leg.instance_rid,
                    "sampling": leg_sampling(sampling, max_tokens, done),
                }
                async with aclosing(self._stream_leg(leg, run, body, len(tokens), done)) as stream:
                    async for ev in stream:  # closed at once if the client goes
                        yield ev
                head = run.head
                if run.failure is not None and not run.finished:
                    failed.append(dec.id)
                    tokens, done = tokens + run.got, done + len(run.got)
                    leg.dec, leg.move_to = self._resume_on(leg, failed, run.failure), None
                    leg.n, src, tid = leg.n + 1, dec, None
                    self.metrics.retries.labels(leg.model, "decode_leg_failed").inc()
                    continue
                if run.moved is None:
                    return
                if leg.move_to is None:
                    raise RuntimeError(
                        f"decode instance {dec.id} moved the request, but not at the "
                        "router's asking"
                    )
                self.background.spawn(kv_sent(self.metrics, dec, run.key, run.resp, run.lines))
                self.metrics.migrations.labels(leg.model, dec.id, leg.move_reason).inc()
                tokens, done = tokens + run.moved["token_ids"], done + len(run.moved["token_ids"])
                src, tid = dec, leg.transfer_id
                leg.dec, leg.n = leg.move_to, leg.n + 1
        finally:
            self.live.pop(leg.id, None)

    async def _stream_leg(
        self, leg: DecodeLeg, run: _LegRun, body: dict, num_prompt: int, done: int
    ) -> AsyncIterator[dict]:
        """One leg on `leg.dec`: `run.head` once it is up, then its chunks with the usage counted
        from the request's start. How it ended goes into `run`; after a migration the response
        stays open for the sender's KV report. `done`: the request's tokens before this leg."""
        dec = leg.dec
        self.metrics.routed.labels(dec.model, dec.id).inc()
        try:
            request = self.client.build_request("POST", dec.url + "/tandem/decode", json=body)
            run.resp = await self.client.send(request, stream=True)
            if run.resp.status_code != 200:
                raise LegFailed(
                    f"answered {run.resp.status_code}: {(await run.resp.aread())[:300]!r}"
                )
            dec.first_token(run.key)
            if leg.move_to is dec:  # the move has landed (a new one may be asked for now)
                leg.move_to = None
            leg.num_tokens = num_prompt
            if run.head is not None:
                yield run.head
                run.head = None
            run.lines = run.resp.aiter_lines()
            async for ev in leg_events(run.lines):
                if "migrate" in ev:
                    run.moved = ev["migrate"]
                    break
                run.got += ev.pop("token_ids", ())
                if ev.get("usage"):  # the leg counts its own tokens
                    ev["usage"]["completion_tokens"] += done
                if "num_tokens" in ev:  # the leg's tokens so far (not the client's to see)
                    leg.num_tokens = num_prompt + ev.pop("num_tokens")
                run.finished = run.finished or any(
                    c.get("finish_reason") for c in ev.get("choices") or ()
                )
                yield ev
        except httpx.HTTPError as e:
            if isinstance(e, httpx.TransportError):
                self.pool.mark_failed(dec, f"{type(e).__name__}: {e}")
            run.failure = f"{type(e).__name__}: {e}"
        except LegFailed as e:
            run.failure = str(e)
        finally:
            if run.moved is None:
                if run.resp is not None:
                    await run.resp.aclose()
                dec.finish(run.key)

    def _resume_on(self, leg: DecodeLeg, failed: list[str], failure: str) -> Instance:
        """Another decode instance with room for the request (the most free KV), or LegFailed."""
        log.warning("decode leg of %s on %s failed: %s", leg.id, failed[-1], failure)
        views = [i.view() for i in self.pool.group(leg.model) if i.id not in failed]
        dst = choose_decode(views, leg.kv_tokens) if len(failed) < self.max_attempts else None
        if dst is None:
            self.metrics.failures.labels(leg.model, "decode_failed").inc()
            raise LegFailed(
                f"the decode leg on {failed[-1]} failed ({failure}) and no other decode instance "
                f"can resume it (tried {', '.join(failed)})"
            )
        return self.pool.instances[dst.instance_id]

    async def migrate(
        self, request_id: str, to: str | None = None, reason: str = "operator"
    ) -> Response:
        """Move a decoding P/D request to another decode instance (`to`, or the one with the
        most free KV that has room for it)."""
        leg = self.live.get(request_id)
        if leg is None:
            return json_error(
                404, f"no P/D request {request_id!r} is decoding (give a response's `id`)"
            )
        if leg.move_to is not None:
            return json_error(409, f"request {request_id!r} is already moving to {leg.move_to.id}")
        if to is not None and to not in self.pool.instances:
            return json_error(404, f"no instance {to!r}; see GET /cluster/state")
        src = leg.dec
        views = [
            i.view() for i in self.pool.group(leg.model) if i.id != src.id and to in (None, i.id)
        ]
        dst = choose_decode(views, leg.kv_tokens)
        if dst is None:
            return json_error(
                503,
                f"no {'' if to is None else to + ' as '}other decode instance with room for "
                f"{leg.kv_tokens} KV tokens",
            )
        leg.move_to = self.pool.instances[dst.instance_id]
        leg.move_reason, leg.transfer_id = reason, uuid.uuid4().hex
        dst_inst = leg.move_to
        try:
            resp = await self.client.post(
                src.url + "/tandem/migrate",
                json={
                    "request_id": leg.instance_rid,
                    "transfer_id": leg.transfer_id,
                    "kv_peer": dst_inst.kv_rank,
                },
            )
            error = (
                None
                if resp.status_code == 200
                else f"{src.id} answered {resp.status_code}: {resp.text[:300]}"
            )
        except httpx.TransportError as e:
            error = f"{src.id}: {type(e).__name__}: {e}"
        if error is not None:
            leg.move_to = None
            return json_error(409, f"request {request_id!r} not moved ({error})")
        return JSONResponse({"id": request_id, "from": src.id, "to": dst_inst.id})
