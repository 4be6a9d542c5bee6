"""The instance side of P/D disaggregation: HTTP over the engine core's P/D utilities
(`tandem.engine.pd_service.PDService`, sent as the messages of `core_messages.py` with
`AsyncLLM.call_utility`), which hold the KV links (shared memory on one host; torch.distributed
point-to-point to a peer rank once POST /tandem/kv_group has joined the group) in the engine
process.

POST /tandem/prefill runs a prompt to its first token, answers it, and sends the KV of its whole
blocks while the router starts the decode leg (a point-to-point send completes only once the
receiver takes it); POST /tandem/decode reserves blocks for that KV, receives it into them layer
by layer, and adds the request (prompt + first token) with `kv_transfer`, which commits the
blocks to its prefix cache with the add, so the request finds them by the ordinary prefix
lookup and recomputes less than a block; it answers with a completions-format SSE stream whose
chunks carry their token ids (the router resumes a failed leg elsewhere from them). A decode
leg that fails before receiving still drains its transfer; one with no `transfer_id` receives
nothing and computes its prompt itself. POST /tandem/migrate moves a
streaming decode leg elsewhere (decode_stream.py)."""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from tandem.core.kv_connector.pd import KVPoolFullError
from tandem.engine.core_messages import DrainKV, JoinKVGroup, ReceiveKV, ReleaseKV, SendKV
from tandem.server.decode_stream import DecodeLegs, send_outcome
from tandem.server.limits import TokenId
from tandem.server.protocol import CompletionRequest
from tandem.server.responses import latency_split

log = logging.getLogger(__name__)
NDJSON = "application/x-ndjson"
router = APIRouter()


Rank = Annotated[int, Field(ge=0, le=65535)]


class PrefillRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    prompt: list[TokenId]
    transfer_id: str
    sampling: dict = {}
    kv_peer: Rank | None = (
        None  # the other side's rank in the KV transfer group; None: shared memory
    )


class DecodeRequest(PrefillRequest):
    transfer_id: (
        str | None
    )  # None: no KV comes; the leg computes its prompt itself (a failed leg resumed)
    stream_usage: bool = True
    request_id: str | None = None  # the router's id for this leg, for POST /tandem/migrate


class MigrateRequest(BaseModel):
    request_id: str
    transfer_id: str
    kv_peer: Rank | None = None


class KVGroupRequest(BaseModel):
    rank: Rank
    world_size: Annotated[int, Field(ge=1, le=65536)]
    host: str
    port: Annotated[int, Field(ge=0, le=65535)]
    backend: str | None = None
    timeout_s: Annotated[float, Field(gt=0, le=3600)] = 120.0


@dataclass(slots=True)
class PDState:
    llm: Any  # AsyncLLM
    model_name: str
    legs: DecodeLegs
    in_cluster: bool  # False: a standalone `tandem serve`, which takes no P/D legs nor a KV group


def add_pd_routes(app: FastAPI, llm: Any, model_name: str, in_cluster: bool) -> None:
    app.state.pd = PDState(llm, model_name, DecodeLegs(llm, model_name), in_cluster)
    app.include_router(router)


def _state(request: Request) -> PDState:
    """409 on a standalone server: these routes are the cluster's (its router and launcher),
    and would have it wait for KV that never comes or reach an address a client names."""
    st: PDState = request.app.state.pd
    if not st.in_cluster:
        raise HTTPException(
            409,
            "this server is not a cluster instance (started without --role): "
            "it takes no P/D legs and joins no KV transfer group",
        )
    return st


def _params(sampling: dict, prompt: list[int], max_tokens: int | None):
    try:
        req = CompletionRequest.model_validate(
            {**sampling, "prompt": prompt, "max_tokens": max_tokens}
        )
        return req.sampling_params(max_tokens, None), req.priority_level
    except ValueError as e:
        raise HTTPException(400, str(e)) from None


@router.post("/tandem/kv_group")
async def kv_group(req: KVGroupRequest, request: Request):
    try:
        rank = await _state(request).llm.call_utility(
            JoinKVGroup(req.rank, req.world_size, req.host, req.port, req.backend, req.timeout_s)
        )
    except ValueError as e:
        raise HTTPException(400, str(e)) from None
    except (RuntimeError, TimeoutError) as e:  # the store is unreachable or a rank never came
        raise HTTPException(503, f"joining the KV transfer group failed: {e}") from None
    return {"rank": rank}


@router.post("/tandem/prefill")
async def prefill(req: PrefillRequest, request: Request):
    """NDJSON: the first token, then (unless it already finished the request) the outcome of
    the KV send, which starts now and completes once the decode side receives it."""
    llm = _state(request).llm
    params, priority = _params(req.sampling, req.prompt, 1)
    final = None
    try:
        async for out in llm.generate(req.prompt, params, f"prefill-{req.transfer_id}", priority):
            final = out
        o = final.outputs[0]
        head = {
            "token_ids": o.token_ids,
            "text": o.text,
            "finish_reason": o.finish_reason,
            "cached_tokens": final.metrics.num_cached_tokens,
            "metrics": latency_split([final]),
        }
        if o.finish_reason != "length":  # stopped at its first token: nothing to hand off
            return StreamingResponse(_ndjson(head), media_type=NDJSON)
        blocks = await llm.call_utility(
            SendKV(req.prompt, req.transfer_id, req.kv_peer)
        )  # a bad peer: 400
    except ValueError as e:
        raise HTTPException(400, str(e)) from None
    return StreamingResponse(
        _ndjson({**head, "kv_blocks": blocks}, llm, req.transfer_id), media_type=NDJSON
    )


async def _ndjson(head: dict, llm: Any = None, transfer_id: str | None = None):
    yield json.dumps(head) + "\n"
    if transfer_id is not None:
        yield json.dumps(await send_outcome(llm, transfer_id)) + "\n"


@router.post("/tandem/decode")
async def decode(req: DecodeRequest, request: Request):
    st = _state(request)
    rid = req.request_id or f"cmpl-{uuid.uuid4().hex}"
    if req.transfer_id is None:
        params, priority = _params(req.sampling, req.prompt, req.sampling.get("max_tokens"))
        try:
            gen = st.llm.generate(req.prompt, params, rid, priority)
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        return _leg_stream(st, gen, rid, req)
    return await _decode_received(st, req, req.transfer_id, rid)


async def _decode_received(
    st: PDState, req: DecodeRequest, tid: str, rid: str
) -> StreamingResponse:
    """A decode leg whose prompt's KV comes from a peer under `tid`."""
    llm = st.llm
    kv_tokens = req.prompt[:-1]  # the prefill side's prompt; the last token is its first output
    try:
        params, priority = _params(req.sampling, req.prompt, req.sampling.get("max_tokens"))
        got = await llm.call_utility(ReceiveKV(kv_tokens, tid, req.kv_peer))
    except (HTTPException, KVPoolFullError, ValueError) as e:
        try:
            await llm.call_utility(DrainKV(tid, req.kv_peer))
        except Exception as drain_error:  # nothing waits on the drain; the log says why
            log.warning("KV transfer %s not drained: %s", tid, drain_error)
        if isinstance(e, HTTPException):
            raise
        raise HTTPException(503 if isinstance(e, KVPoolFullError) else 400, str(e)) from None
    if "error" in got:  # timed out, peer gone, or a payload that does not fit: nothing is kept
        await llm.call_utility(ReleaseKV(tid))
        raise HTTPException(502, f"KV transfer {tid} failed: {got['error']}")
    # The engine commits the received blocks with the add, before a step can schedule the
    # request. Not the reserved tokens (or a reused id): released, and it recomputes its prompt.
    try:
        gen = llm.generate(req.prompt, params, rid, priority, kv_transfer={"transfer_id": tid})
    except (
        ValueError
    ) as e:  # the front end refused it: the core never sees the add, so give the KV back here
        await llm.call_utility(ReleaseKV(tid))
        raise HTTPException(400, str(e)) from None
    return _leg_stream(st, gen, rid, req)


def _leg_stream(st: PDState, gen, rid: str, req: DecodeRequest) -> StreamingResponse:
    return StreamingResponse(
        st.legs.stream(gen, rid, req.prompt, req.stream_usage), media_type="text/event-stream"
    )


@router.post("/tandem/migrate")
async def migrate(req: MigrateRequest, request: Request):
    """Move a streaming decode leg: its stream ends with the tokens so far, its KV goes to
    `kv_peer` under `transfer_id`, where the router continues it."""
    try:
        moving = await _state(request).legs.migrate(req.request_id, req.transfer_id, req.kv_peer)
    except ValueError as e:
        raise HTTPException(400, str(e)) from None
    if not moving:
        raise HTTPException(404, f"no decode leg {req.request_id!r} is streaming here")
    return {"request_id": req.request_id, "migrating": True}
