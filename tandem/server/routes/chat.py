"""POST /v1/chat/completions: the conversation through the one chat prompt (engine/chat.py),
tool calls by forced schema (tool_calls.py), whole or streamed."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from tandem.core.sampling_params import StructuredOutputsParams
from tandem.engine.output_processor import RequestOutput
from tandem.server import responses as R
from tandem.server import serving as S
from tandem.server.errors import APIError
from tandem.server.protocol import ChatCompletionRequest
from tandem.server.state import serving_state
from tandem.server.tool_calls import ToolCallPlan, plan_tool_calls

router = APIRouter()


def tool_plan(req: ChatCompletionRequest, so: StructuredOutputsParams | None) -> ToolCallPlan | None:
    try:
        tools = plan_tool_calls(req)
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from None
    if tools is not None and so is not None:
        raise APIError(400, "tool calls force their own output schema: drop response_format / "
                       "structured_outputs / guided_*, or set tool_choice to 'none'", param="tool_choice")
    return tools


@router.post("/v1/chat/completions")
async def create_chat_completion(req: ChatCompletionRequest, request: Request):
    state = serving_state(request)
    S.check_admission(state, req.model, req.n)
    so = S.constraint_of(req)
    tools = tool_plan(req, so)
    tokenizer = state.facts.tokenizer
    try:
        text = req.chat_prompt(tokenizer)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    ids = S.encode(state, text)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs `logprobs: true`", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if tools is not None:
        so = tools.constraint
    params = S.sampling_params(state, req, len(ids), max_tokens, logprobs, so)
    how = S.choose(state, req, request)  # before the compile: a refused precision costs no compile, no count
    await S.compile_constraint(state, so, "tool_calls" if tools is not None else None)
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), state.config.model_name
    gen = S.generate(state, ids, params, how, rid)
    if not req.stream:
        out = (await S.collect(request, [gen]))[0]
        return R.chat_body(rid, model, created, out, req.logprobs, tokenizer, tools)
    return S.sse(chat_chunks(req, rid, model, created, gen, tokenizer, tools))


async def chat_chunks(req: ChatCompletionRequest, rid: str, model: str, created: int,
                      gen: AsyncIterator[RequestOutput], tokenizer, tools: ToolCallPlan | None) -> AsyncIterator[dict]:
    """The role chunk, the deltas, then the usage chunk if asked for."""
    yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for i in range(req.n)]}
    final, finish_sent = None, set()
    async for out in gen:
        final = out
        chunk = R.chat_chunk(rid, model, created, out, finish_sent, req.logprobs, tokenizer, tools)
        if chunk:
            yield chunk
    if req.stream_options and req.stream_options.include_usage:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [], "usage": R.usage([final]), "metrics": R.latency_split([final])}
