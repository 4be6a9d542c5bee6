"""POST /v1/completions: one or several prompts, n choices each (the best n of best_of), the
prompt echoed before them (with its logprobs: `echo`, `max_tokens` 0 for the prompt alone),
whole or streamed."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from tandem.engine.output_processor import RequestOutput
from tandem.server import responses as R
from tandem.server import serving as S
from tandem.server.errors import APIError
from tandem.server.protocol import CompletionRequest
from tandem.server.state import serving_state

router = APIRouter()


def prompts_of(req: CompletionRequest) -> list[str | list[int]]:
    """A batch (a list of texts or of token-id lists) or one prompt."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return list(prompt)
    return [prompt]


def check_request(req: CompletionRequest) -> None:
    if req.max_tokens == 0 and not req.echo:
        raise APIError(
            400,
            "max_tokens 0 answers with the prompt alone: it needs `echo: true`",
            param="max_tokens",
        )
    if req.best_of is not None and (req.best_of < req.n or req.stream):
        raise APIError(
            400, f"best_of must be at least n ({req.n}), and is not streamed", param="best_of"
        )
    S.check_streamed(req, ": use echo with logprobs")


@router.post("/v1/completions")
async def create_completion(req: CompletionRequest, request: Request):
    state = serving_state(request)
    check_request(req)
    S.check_admission(state, req.model, req.best_of or req.n)
    prompts = prompts_of(req)
    encoded = [
        S.encode(state, p, req.add_special_tokens, req.truncate_prompt_tokens) for p in prompts
    ]
    so = S.constraint_of(req)
    prompt_only = req.echo and req.max_tokens == 0  # one token runs for the prompt's logprobs
    max_tokens = 1 if prompt_only else req.max_tokens
    logprobs = req.logprobs if req.best_of is None else req.logprobs or 0  # best_of ranks by them
    fanout = {"n": req.best_of or req.n, "prompt_logprobs": engine_prompt_logprobs(req)}
    params = [
        dataclasses.replace(
            S.sampling_params(state, req, len(ids), max_tokens, logprobs, so), **fanout
        )
        for ids in encoded
    ]
    how = S.choose(state, req, request)  # before the compile: a refused precision costs nothing
    await S.compile_constraint(state, so)
    rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), state.config.model_name
    gens = [
        S.generate(state, ids, sp, how, f"{rid}-{i}")
        for i, (ids, sp) in enumerate(zip(encoded, params))
    ]
    if prompt_only:
        gens = [without_output(g) for g in gens]
    fmt = answer_format(req, prompts, encoded, state.facts.tokenizer)
    if not req.stream:
        outs = await S.collect(request, gens)
        if req.best_of is not None:
            outs = [best_n(out, req.n, req.logprobs is not None) for out in outs]
        return R.completion_body(rid, model, created, outs, fmt)
    return S.sse(completion_chunks(req, rid, model, created, gens, fmt))


def engine_prompt_logprobs(req: CompletionRequest) -> int | None:
    """Alternatives per prompt token the engine computes: for `prompt_logprobs`, and for `echo`
    with `logprobs`."""
    asked = [req.prompt_logprobs, req.logprobs if req.echo else None]
    return max((k for k in asked if k is not None), default=None)


def answer_format(
    req: CompletionRequest, prompts: list[str | list[int]], encoded: list[list[int]], tokenizer
) -> R.CompletionFormat:
    echo = None
    if req.echo:
        echo = [echo_text(p, ids, req, tokenizer) for p, ids in zip(prompts, encoded)]
    return R.CompletionFormat(
        req.n,
        R.Tokens(tokenizer, req.return_tokens_as_token_ids),
        req.logprobs,
        echo,
        req.prompt_logprobs,
        S.continuous_usage(req),
    )


def echo_text(prompt: str | list[int], ids: list[int], req: CompletionRequest, tokenizer) -> str:
    """The prompt as sent, or as the model read it where it was given as ids or truncated."""
    if isinstance(prompt, str) and req.truncate_prompt_tokens is None:
        return prompt
    return tokenizer.decode(ids) if tokenizer is not None else ""


async def without_output(gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """`echo` with `max_tokens` 0: the token run for the prompt's logprobs is not in the answer."""
    async for out in gen:
        for c in out.outputs:
            c.text = c.delta_text = ""
            c.token_ids, c.delta_token_ids = [], []
            c.logprobs = None if c.logprobs is None else []
            if c.finished:
                c.finish_reason, c.stop_reason = "length", None
        yield out


def best_n(out: RequestOutput, n: int, keep_logprobs: bool) -> RequestOutput:
    """best_of: the n choices of highest cumulative logprob, best first."""
    ranked = sorted(out.outputs, key=lambda c: sum(e[0][1] for e in c.logprobs or []), reverse=True)
    return dataclasses.replace(
        out,
        outputs=[
            dataclasses.replace(c, index=i, logprobs=c.logprobs if keep_logprobs else None)
            for i, c in enumerate(ranked[:n])
        ],
    )


async def completion_chunks(
    req: CompletionRequest,
    rid: str,
    model: str,
    created: int,
    gens: list[AsyncIterator[RequestOutput]],
    fmt: R.CompletionFormat,
) -> AsyncIterator[dict]:
    """The prompts' streams merged as their outputs come, then the usage chunk if asked for."""
    finals: list[RequestOutput | None] = [None] * len(gens)
    sent = [R.Sent() for _ in gens]
    queue: asyncio.Queue = asyncio.Queue()

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
            chunk = R.completion_chunk(rid, model, created, i, out, sent[i], fmt)
            if chunk:
                yield chunk
        head = {"id": rid, "object": "text_completion", "created": created, "model": model}
        if (last := S.usage_chunk(req, head, finals)) is not None:
            yield last
    finally:
        for t in tasks:
            t.cancel()
