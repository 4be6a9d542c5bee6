"""POST /v1/completions: one or several prompts, n choices each, whole or streamed."""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from tandem.engine.output_processor import RequestOutput
from tandem.server import responses as R
from tandem.server import serving as S
from tandem.server.protocol import CompletionRequest
from tandem.server.state import serving_state

router = APIRouter()


def prompts_of(req: CompletionRequest) -> list[str | list[int]]:
    """A batch (a list of texts or of token-id lists) or one prompt."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return list(prompt)
    return [prompt]


@router.post("/v1/completions")
async def create_completion(req: CompletionRequest, request: Request):
    state = serving_state(request)
    S.check_admission(state, req.model, req.n)
    encoded = [S.encode(state, p) for p in prompts_of(req)]
    so = S.constraint_of(req)
    params = [S.sampling_params(state, req, len(ids), req.max_tokens, req.logprobs, so) for ids in encoded]
    how = S.choose(state, req, request)  # before the compile: a refused precision costs no compile, no count
    await S.compile_constraint(state, so)
    rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), state.config.model_name
    gens = [S.generate(state, ids, sp, how, f"{rid}-{i}") for i, (ids, sp) in enumerate(zip(encoded, params))]
    want_lp, tokenizer = req.logprobs is not None, state.facts.tokenizer
    if not req.stream:
        outs = await S.collect(request, gens)
        return R.completion_body(rid, model, created, outs, req.n, want_lp, tokenizer)
    return S.sse(completion_chunks(req, rid, model, created, gens, tokenizer))


async def completion_chunks(req: CompletionRequest, rid: str, model: str, created: int,
                            gens: list[AsyncIterator[RequestOutput]], tokenizer) -> AsyncIterator[dict]:
    """The prompts' streams merged as their outputs come, then the usage chunk if asked for."""
    finals: list[RequestOutput | None] = [None] * len(gens)
    finish_sent: list[set[int]] = [set() for _ in gens]
    queue: asyncio.Queue = asyncio.Queue()
    want_lp = req.logprobs is not None

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await queue.put((i, out))
        except Exception as e:
            await queue.put((i, e))
        await queue.put((i, None))
    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            i, out = await queue.get()
            if out is None:
                remaining -= 1
                continue
            if isinstance(out, Exception):
                raise out
            finals[i] = out
            chunk = R.completion_chunk(rid, model, created, i, req.n, out, finish_sent[i], want_lp, tokenizer)
            if chunk:
                yield chunk
        if req.stream_options and req.stream_options.include_usage:
            yield {"id": rid, "object": "text_completion", "created": created, "model": model,
                   "choices": [], "usage": R.usage(finals), "metrics": R.latency_split(finals)}
    finally:
        for t in tasks:
            t.cancel()
