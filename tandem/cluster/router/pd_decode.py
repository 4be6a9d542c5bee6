"""The decode side of a P/D request in the router: a chain of decode legs. The first continues
from the prefill side's first token; a migration (POST /tandem/migrate on the router, by the
response's id, or `migrate_loop.py` when a decode instance runs short of KV) ends the leg on
one decode instance, which sends the request's KV to another, and the next leg continues
there from exactly the tokens streamed so far. The client's stream goes on with no token
twice and none missing; greedy output is that of an unmoved run."""
from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from fastapi.responses import JSONResponse, Response

from tandem.cluster.router.background import Background
from tandem.cluster.router.pool import Instance
from tandem.cluster.router.proxy import json_error
from tandem.cluster.router.metrics import RouterMetrics
from tandem.cluster.policy.routing import choose_decode

if TYPE_CHECKING:
    from tandem.cluster.router.app import Router

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


def leg_sampling(sampling: dict, max_tokens: int | None, done: int) -> dict:
    """A leg's sampling options once `done` tokens of the request are out."""
    out = {**sampling, "max_tokens": None if max_tokens is None else max_tokens - done}
    if "min_tokens" in sampling:
        out["min_tokens"] = max(0, (sampling["min_tokens"] or 0) - done)
    return out


async def kv_sent(metrics: RouterMetrics, inst: Instance, key: int, resp: httpx.Response,
                  lines: AsyncIterator[str]) -> None:
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


class DecodeChain:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.live: dict[str, DecodeLeg] = {}  # by response id
        self.background = Background()

    async def events(self, leg: DecodeLeg, src: Instance, tokens: list[int], head: dict, sampling: dict,
                     max_tokens: int | None, tid: str) -> AsyncIterator[dict]:
        """`head` (the prefill side's token) once the first leg is up, then the decode legs'
        completion chunks. Raises before `head` if the first leg cannot start."""
        # "length" is only the prefill leg's max_tokens=1; a stop (EOS, stop token or string) is final.
        head = {**head, "finish_reason": None if head["finish_reason"] == "length" else head["finish_reason"]}
        if head["finish_reason"] is not None:
            yield head
            return
        r, done = self.router, len(head["token_ids"])  # tokens out so far: the prefill side's
        self.live[leg.id] = leg
        try:
            while True:
                dec, resp, moved = leg.dec, None, None
                key = dec.start(0)
                r.metrics.routed.labels(dec.model, dec.id).inc()
                body = {"prompt": tokens, "transfer_id": tid, "kv_peer": src.kv_rank, "request_id": leg.instance_rid,
                        "sampling": leg_sampling(sampling, max_tokens, done)}
                try:
                    resp = await r.client.send(r.client.build_request("POST", dec.url + "/tandem/decode", json=body),
                                               stream=True)
                    if resp.status_code != 200:
                        raise httpx.RemoteProtocolError(f"decode instance {dec.id} answered {resp.status_code}: "
                                                        f"{(await resp.aread())[:300]!r}")
                    dec.first_token(key)
                    if leg.move_to is dec:  # the move has landed (a new one may be asked for now)
                        leg.move_to = None
                    leg.num_tokens = len(tokens)
                    if head is not None:
                        yield head
                        head = None
                    lines = resp.aiter_lines()
                    async for line in lines:
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        ev = json.loads(line[6:])
                        if "migrate" in ev:
                            moved = ev["migrate"]
                            break
                        if ev.get("usage"):  # the leg counts its own tokens
                            ev["usage"]["completion_tokens"] += done
                        if "num_tokens" in ev:  # the leg's tokens so far (not the client's to see)
                            leg.num_tokens = len(tokens) + ev.pop("num_tokens")
                        yield ev
                finally:
                    if moved is None:
                        if resp is not None:
                            await resp.aclose()
                        dec.finish(key)
                if moved is None:
                    return
                if leg.move_to is None:
                    raise RuntimeError(f"decode instance {dec.id} moved the request, but not at the router's asking")
                self.background.spawn(kv_sent(r.metrics, dec, key, resp, lines))
                r.metrics.migrations.labels(leg.model, dec.id, leg.move_reason).inc()
                tokens, done = tokens + moved["token_ids"], done + len(moved["token_ids"])
                src, tid = dec, leg.transfer_id
                leg.dec, leg.n = leg.move_to, leg.n + 1
        finally:
            self.live.pop(leg.id, None)

    async def migrate(self, request_id: str, to: str | None = None, reason: str = "operator") -> Response:
        """Move a decoding P/D request to another decode instance (`to`, or the one with the
        most free KV that has room for it)."""
        r = self.router
        leg = self.live.get(request_id)
        if leg is None:
            return json_error(404, f"no P/D request {request_id!r} is decoding (give a response's `id`)")
        if leg.move_to is not None:
            return json_error(409, f"request {request_id!r} is already moving to {leg.move_to.id}")
        if to is not None and to not in r.pool.instances:
            return json_error(404, f"no instance {to!r}; see GET /cluster/state")
        src = leg.dec
        views = [i.view() for i in r.pool.group(leg.model) if i.id != src.id and to in (None, i.id)]
        dst = choose_decode(views, leg.kv_tokens)
        if dst is None:
            return json_error(503, f"no {'' if to is None else to + ' as '}other decode instance with room for "
                                   f"{leg.kv_tokens} KV tokens")
        leg.move_to, leg.move_reason, leg.transfer_id = r.pool.instances[dst.instance_id], reason, uuid.uuid4().hex
        dst_inst = leg.move_to
        try:
            resp = await r.client.post(src.url + "/tandem/migrate", json={
                "request_id": leg.instance_rid, "transfer_id": leg.transfer_id, "kv_peer": dst_inst.kv_rank})
            error = None if resp.status_code == 200 else f"{src.id} answered {resp.status_code}: {resp.text[:300]}"
        except httpx.TransportError as e:
            error = f"{src.id}: {type(e).__name__}: {e}"
        if error is not None:
            leg.move_to = None
            return json_error(409, f"request {request_id!r} not moved ({error})")
        return JSONResponse({"id": request_id, "from": src.id, "to": dst_inst.id})
