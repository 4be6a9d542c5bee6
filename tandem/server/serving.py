"""The steps the generate routes (completions, chat) share: admission (model, n, 429), the
request's constraint, sampling params, priority and precision, the engine's stream with its
errors as APIError, and the two ways out: a whole body once every output finished, or SSE.

Prompt rules (empty, at or past max_model_len, token ids outside the vocabulary) are the
engine's: they are not checked here, the engine's ValueError becomes the 400."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from tandem.core.sampling_params import SamplingParams, StructuredOutputsParams
from tandem.engine.output_processor import RequestOutput
from tandem.server import responses as R
from tandem.server.auth import presented_key
from tandem.server.errors import APIError
from tandem.server.precision import key_priority, request_precision, split_model
from tandem.server.protocol import SamplingFields
from tandem.server.state import ServingState

Choice = tuple[int | None, str | None]  # (priority, precision)


def check_admission(state: ServingState, model: str | None, n: int) -> None:
    config = state.config
    names = config.served_model_names
    model, _ = split_model(model, names)
    if model is not None and model not in names and state.loras.get(model) is None:
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves "
            f"{', '.join(f'`{n}`' for n in names)}.",
            "not_found_error",
            "model",
        )
    if n > config.max_n:
        raise APIError(400, f"n must be at most {config.max_n}, got {n}", param="n")
    if state.llm.num_waiting >= config.max_waiting:
        raise APIError(
            429,
            f"server overloaded: {state.llm.num_waiting} requests waiting",
            "rate_limit_error",
            headers={"Retry-After": "1"},
        )


def encode(
    state: ServingState,
    prompt: str | list[int],
    add_special_tokens: bool = True,
    truncate: int | None = None,
) -> list[int]:
    """The prompt's token ids, by the engine's rules; `truncate` (vLLM's truncate_prompt_tokens):
    only its last k tokens, -1 for the context's length."""
    try:
        if isinstance(prompt, str) and not add_special_tokens:
            if state.facts.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            prompt = state.facts.tokenizer.encode(prompt, add_special_tokens=False)
        ids = state.facts.tokenize(prompt)
    except ValueError as e:
        raise APIError(400, str(e), param="prompt") from None
    if truncate is None:
        return ids
    if truncate == 0:
        raise APIError(
            400, "truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens"
        )
    return ids[-(state.facts.max_model_len if truncate == -1 else truncate) :]


def check_streamed(req: SamplingFields, instead: str = "") -> None:
    """What a stream cannot carry: prompt_logprobs (a 400; `instead`: what to ask for)."""
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(
            400, f"prompt_logprobs are not streamed (vLLM's rule){instead}", param="prompt_logprobs"
        )


def usage_chunk(req: SamplingFields, head: dict, outs: list[RequestOutput]) -> dict | None:
    """stream_options.include_usage's last chunk (no choices: the whole request's usage), or
    None."""
    if not (req.stream_options and req.stream_options.include_usage):
        return None
    return {**head, "choices": [], "usage": R.usage(outs), "metrics": R.latency_split(outs)}


def continuous_usage(req: SamplingFields) -> bool:
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far."""
    return bool(req.stream_options and req.stream_options.continuous_usage_stats)


def constraint_of(req: SamplingFields) -> StructuredOutputsParams | None:
    try:
        return req.constraint()
    except ValueError as e:
        raise APIError(400, str(e)) from None


async def compile_constraint(
    state: ServingState, so: StructuredOutputsParams | None, kind: str | None = None
) -> None:
    """Compile the request's constraint (or find it cached) off the engine's step path, so no
    step waits for it; a bad one is a 400."""
    if so is None:
        return
    try:
        await state.facts.compile_grammar(so)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    state.metrics.structured_requests.labels(state.config.model_name, kind or so.kind).inc()


def sampling_params(
    state: ServingState,
    req: SamplingFields,
    prompt_len: int,
    max_tokens: int | None,
    logprobs: int | None,
    so: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The request's SamplingParams (their own rules, as ValueError -> 400), and max_tokens within
    the room the context leaves after a prompt that fits (one that does not is the engine's 400):
    an OpenAI server refuses what it would otherwise cut short."""
    limit = state.facts.max_model_len
    if max_tokens is not None and prompt_len < limit < prompt_len + max_tokens:
        raise APIError(
            400,
            f"max_tokens {max_tokens} + prompt {prompt_len} tokens exceeds the context "
            f"of {limit} tokens",
            param="max_tokens",
        )
    try:
        params = req.sampling_params(max_tokens, logprobs, so)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    params.lora_request = state.loras.get(req.model)  # `model` names an adapter, or the base
    return params


def choose(state: ServingState, req: SamplingFields, request: Request) -> Choice:
    """(priority, precision): the request's own, else its API key's class; 400 if not served."""
    config = state.config
    priority = req.priority_level or key_priority(presented_key(request), config.api_key_classes)
    try:
        return priority, request_precision(
            req.precision,
            split_model(req.model, config.served_model_names)[1],
            state.facts.precisions,
        )
    except ValueError as e:
        raise APIError(400, str(e), param="precision") from None


def generate(
    state: ServingState, prompt_ids: list[int], params: SamplingParams, how: Choice, request_id: str
) -> AsyncIterator[RequestOutput]:
    """The engine's stream of the request, queued now (it counts for 429 from here on); the
    engine's ValueError, at the call or while iterating, is a 400."""
    try:
        stream = state.llm.generate(prompt_ids, params, request_id, how[0], precision=how[1])
    except ValueError as e:
        raise APIError(400, str(e)) from None

    async def outputs() -> AsyncIterator[RequestOutput]:
        try:
            async for out in stream:
                yield out
        except ValueError as e:
            raise APIError(400, str(e)) from None

    return outputs()


async def collect(
    request: Request, gens: list[AsyncIterator[RequestOutput]]
) -> list[RequestOutput]:
    """Run to completion (the last output of each); the first failure ends them all, and so does
    the client going away (which aborts them in the engine)."""

    async def last(gen: AsyncIterator[RequestOutput]) -> RequestOutput | None:
        out = None
        async for item in gen:
            out = item
        return out

    tasks = [asyncio.ensure_future(last(g)) for g in gens]
    gone = asyncio.ensure_future(disconnected(request))
    pending = {*tasks, gone}
    try:
        while True:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if gone in done:  # the answer goes nowhere; the finally aborts the requests
                raise APIError(499, "the client closed the request", "client_closed")
            failed = next((t for t in done if t.exception() is not None), None)
            if failed is not None:
                raise failed.exception()
            if pending == {gone}:
                return [t.result() for t in tasks]
    finally:
        for t in [*tasks, gone]:
            t.cancel()


async def disconnected(request: Request) -> None:
    """Returns once the client has gone. The request body is read already, so the next ASGI
    message is the disconnect (a blocking receive: `is_disconnected()` only peeks, and sees
    nothing behind an http middleware)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events of the chunks, then [DONE]; an error mid-stream is the last event."""

    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield R.sse_event(chunk)
        except APIError as e:
            yield R.error_event(e.message, e.status, e.type)
        except RuntimeError as e:
            yield R.error_event(str(e))
        yield R.SSE_DONE

    return StreamingResponse(body(), media_type="text/event-stream")
