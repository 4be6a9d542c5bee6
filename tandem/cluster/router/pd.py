"""P/D handoff in the router. `routing.route_pd` picks a prefill and a decode instance; the
prefill instance runs the prompt to its first token and ships its KV (shared memory on one
host, or torch.distributed point-to-point between the two instances' ranks) while the decode
instance, which continues from prompt + first token, receives it. The client sees one normal
OpenAI response: the first token from the prefill side, the rest from the decode side, one id.
Anything the split cannot serve exactly (no token ids, n > 1, logprobs, a field outside
PD_KEYS such as a grammar constraint) goes the plain way."""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.cluster.config import RouterConfig
from tandem.cluster.policy.routing import InstanceState, route_pd
from tandem.cluster.router.metrics import RouterMetrics
from tandem.cluster.router.pd_decode import DecodeChain, DecodeLeg, LegFailed, kv_sent
from tandem.cluster.router.pd_format import PDFormat
from tandem.cluster.router.pool import Instance, InstancePool
from tandem.cluster.router.proxy import Proxy, Retry, json_error

SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "priority",
)
# The other fields the split serves: the prompt, its length limit and how the answer is sent.
# A request with any field outside these (structured outputs, tools, precision, speculation
# opt-out, ...) goes the plain way, to one instance that honours it or refuses it in words.
PD_KEYS = frozenset(
    SAMPLING_KEYS
    + (
        "model",
        "prompt",
        "messages",
        "add_generation_prompt",
        "max_tokens",
        "max_completion_tokens",
        "stream",
        "stream_options",
        "n",
        "logprobs",
        "top_logprobs",
        "echo",
        "user",
        "metadata",
    )
)
ROOM_WAIT_S = 5.0  # how long a request waits for a decode instance with room for its KV


def requested_max_tokens(path: str, body: dict) -> int | None:
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if not path.endswith("/chat/completions") and max_tokens is None:
        return 16  # the completions API's default
    return max_tokens


def splittable(body: dict, max_tokens: int | None) -> bool:
    """Whether the split serves the request exactly: one choice, no logprobs or echo, more than
    one token, and no field outside PD_KEYS."""
    logprobs = body.get("logprobs")
    return (
        body.get("n", 1) == 1
        and (logprobs is None or logprobs is False)
        and not body.get("echo")
        and max_tokens != 1
        and PD_KEYS.issuperset(body)
    )


class PDHandoff:
    def __init__(
        self,
        rcfg: RouterConfig,
        pool: InstancePool,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        proxy: Proxy,
    ) -> None:
        self.rcfg, self.pool, self.client, self.metrics = rcfg, pool, client, metrics
        self.proxy = proxy
        self.chain = DecodeChain(pool, client, metrics, rcfg.max_attempts)

    def applies(self, model: str) -> bool:
        roles = {i.state.role for i in self.pool.group(model) if i.state.available}
        return {"prefill", "decode"} <= roles

    async def handle(
        self,
        model: str,
        path: str,
        body: dict,
        stream: bool,
        ids: list[int] | None,
        hashes: list[int],
    ) -> Response:
        raw = json.dumps(body).encode()
        plain = functools.partial(
            self.proxy.forward,
            model,
            path,
            raw,
            stream,
            hashes,
            len(ids or ()),
            self.rcfg.max_attempts,
        )
        max_tokens = requested_max_tokens(path, body)
        if not ids or not splittable(body, max_tokens):
            return await plain()
        pre, dec = await self._pair(model, ids, max_tokens, hashes)
        if dec is None:
            self.metrics.failures.labels(model, "no_decode_room").inc()
            return json_error(
                503,
                f"model `{model}`: no decode instance has room for {len(ids) + (max_tokens or 1)} "
                "KV tokens; retry later",
            )
        dec_inst = self.pool.instances[dec.instance_id]
        if pre is None:  # an idle decode instance prefills this short prompt itself
            out = await self.proxy.attempt(dec_inst, path, raw, stream, len(ids))
            return out if not isinstance(out, Retry) else await plain()
        pre_inst = self.pool.instances[pre.instance_id]
        out = await self._split(model, path, body, stream, ids, pre_inst, dec_inst, max_tokens)
        return out if out is not None else await plain()

    async def _pair(
        self, model: str, ids: list[int], max_tokens: int | None, hashes: list[int]
    ) -> tuple[InstanceState | None, InstanceState | None]:
        """(prefill, decode) views by `route_pd`, waiting up to ROOM_WAIT_S for a decode instance
        with room for the request's KV (decode None: none had it)."""
        deadline = time.monotonic() + ROOM_WAIT_S
        while True:
            views = [i.view() for i in self.pool.group(model)]
            pre, dec = route_pd(
                views, len(ids), len(ids) + (max_tokens or 1), hashes, self.rcfg.weights
            )
            if dec is not None or time.monotonic() > deadline:
                return pre, dec
            await asyncio.sleep(self.rcfg.poll_interval_s)

    async def _split(
        self,
        model: str,
        path: str,
        body: dict,
        stream: bool,
        ids: list[int],
        pre_inst: Instance,
        dec_inst: Instance,
        max_tokens: int | None,
    ) -> Response | None:
        """The prefill leg, then the decode legs, as one response; None if either could not
        start (the caller serves it the plain way)."""
        tid, sampling = uuid.uuid4().hex, {k: body[k] for k in SAMPLING_KEYS if k in body}
        first = await self._prefill(pre_inst, dec_inst, ids, tid, sampling)
        if first is None:  # prefill instance gone or refused
            self.metrics.retries.labels(model, "prefill_failed").inc()
            return None
        fmt = PDFormat(model, path.endswith("/chat/completions"), len(ids), body)
        leg = DecodeLeg(fmt.rid, model, dec_inst, len(ids) + (max_tokens or 1))
        events = self.chain.events(
            leg, pre_inst, ids + first["token_ids"], first, sampling, max_tokens, tid
        )
        try:
            head = await anext(events)  # a decode leg is up (or the request already finished)
        except (LegFailed, StopAsyncIteration):  # no decode instance could start it
            self.metrics.retries.labels(model, "decode_failed").inc()
            return None
        served = {
            "x-tandem-instance": f"{pre_inst.id}+{leg.dec.id}"
        }  # where the first leg that started runs
        if stream:
            return StreamingResponse(
                fmt.sse(head, events), media_type="text/event-stream", headers=served
            )
        try:
            return JSONResponse(await fmt.body(head, events), headers=served)
        except (httpx.HTTPError, RuntimeError) as e:
            self.metrics.failures.labels(model, "stream_broken").inc()
            return json_error(
                502, f"decode side of {fmt.rid} failed mid-request: {type(e).__name__}: {e}"
            )

    async def _prefill(
        self, pre: Instance, dec: Instance, ids: list[int], tid: str, sampling: dict
    ) -> dict | None:
        """The prompt's first token from `pre` (None if it failed). Its KV is then on its way to
        `dec`: a task reads the send's outcome and keeps `pre` counted busy until it is done,
        while the caller starts the decode leg (a point-to-point send waits for the receive)."""
        key = pre.start(len(ids))
        self.metrics.routed.labels(pre.model, pre.id).inc()
        body = {"prompt": ids, "transfer_id": tid, "sampling": sampling, "kv_peer": dec.kv_rank}
        resp = None
        try:
            request = self.client.build_request("POST", pre.url + "/tandem/prefill", json=body)
            resp = await self.client.send(request, stream=True)
            if resp.status_code != 200:
                return None
            lines = resp.aiter_lines()
            first = json.loads(await anext(lines))
            if first["finish_reason"] == "length":  # the KV follows
                self.chain.background.spawn(kv_sent(self.metrics, pre, key, resp, lines))
                resp = key = None  # the task closes them
            return first
        except (httpx.TransportError, StopAsyncIteration, ValueError) as e:
            if isinstance(e, httpx.TransportError):
                self.pool.mark_failed(pre, f"{type(e).__name__}: {e}")
            return None
        finally:
            if resp is not None:
                await resp.aclose()
            if key is not None:
                pre.finish(key)
