"""POST /v1/chat/completions: the conversation through the one chat prompt (engine/chat.py),
tool calls read by the served family's parser (tool_calls.py), whole or streamed."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request

from tandem.core.sampling_params import StructuredOutputsParams
from tandem.engine.output_processor import RequestOutput
from tandem.server import responses as R
from tandem.server import serving as S
from tandem.server.chat_responses import ChatFormat, ChatSent, chat_body, chat_chunk
from tandem.server.errors import APIError
from tandem.server.protocol import ChatCompletionRequest
from tandem.server.reasoning_parser import ThinkParser, reasoning_parser, thinking_budget
from tandem.server.state import ServingState, serving_state
from tandem.server.tool_calls import ToolCallPlan, plan_tool_calls
from tandem.server.tool_parsers import tool_parser
from tandem.server.tool_parsers.base import ToolParser

router = APIRouter()


def tool_plan(
    req: ChatCompletionRequest, so: StructuredOutputsParams | None, family: ToolParser
) -> ToolCallPlan | None:
    try:
        tools = plan_tool_calls(req, family)
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from None
    if tools is not None and so is not None:
        raise APIError(
            400,
            "tool calls force their own output schema: drop response_format / "
            "structured_outputs / guided_*, or set tool_choice to 'none'",
            param="tool_choice",
        )
    return tools


def check_request(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs `logprobs: true`", param="top_logprobs")
    S.check_streamed(req)


def render_prompt(
    state: ServingState, req: ChatCompletionRequest, family: ToolParser | None = None
) -> str:
    """The prompt text a chat request runs on, and the one /tokenize and count_tokens count:
    its tools in the served tool-call format (`family`, else --tool-call-parser's), thinking
    off under --reasoning-budget 0; a 400 for messages the template cannot render."""
    tokenizer = state.facts.tokenizer
    family = family or tool_parser(state.config.tool_call_parser, tokenizer)
    if state.config.reasoning_budget == 0:  # thinking off: the template's switch
        req = req.model_copy(update={"reasoning_effort": "none"})
    try:
        return req.chat_prompt(tokenizer, family)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None


@dataclass(slots=True)
class ChatRun:
    """A chat request on its way: the engine's stream of it, and how to read its output."""

    gen: AsyncIterator[RequestOutput]
    tools: ToolCallPlan | None
    think: ThinkParser | None  # a reasoning model's
    prompt_len: int


async def start_chat(req: ChatCompletionRequest, request: Request, rid: str) -> ChatRun:
    """Admission, the prompt, the tool-call plan and sampling params, the constraint compiled,
    and the request queued. The Messages and Responses APIs come through here too."""
    state = serving_state(request)
    check_request(req)
    S.check_admission(state, req.model, req.n)
    so = S.constraint_of(req)
    tokenizer = state.facts.tokenizer
    family = tool_parser(state.config.tool_call_parser, tokenizer)
    tools = tool_plan(req, so, family)
    text = render_prompt(state, req, family)
    ids = S.encode(state, text, req.add_special_tokens, req.truncate_prompt_tokens)
    max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if tools is not None:
        so = tools.constraint
    params = S.sampling_params(state, req, len(ids), max_tokens, logprobs, so)
    if tools is not None and not tools.parser.skip_special_tokens:
        params.skip_special_tokens = False  # the calls' marker is a special token
    think = reasoning_parser(state.config.reasoning_parser, tokenizer, text)
    budget = req.thinking_token_budget
    params.thinking_budget = thinking_budget(
        think, state.config.reasoning_budget if budget is None else budget, tokenizer
    )
    how = S.choose(state, req, request)  # before the compile: a refused precision costs nothing
    await S.compile_constraint(state, so, "tool_calls" if tools is not None else None)
    return ChatRun(S.generate(state, ids, params, how, rid), tools, think, len(ids))


@router.post("/v1/chat/completions")
async def create_chat_completion(req: ChatCompletionRequest, request: Request):
    state = serving_state(request)
    rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), state.config.model_name
    run = await start_chat(req, request, rid)
    fmt = ChatFormat(
        R.Tokens(state.facts.tokenizer, req.return_tokens_as_token_ids),
        req.logprobs,
        run.tools,
        run.think,
        req.prompt_logprobs,
        S.continuous_usage(req),
    )
    if not req.stream:
        out = (await S.collect(request, [run.gen]))[0]
        return chat_body(rid, model, created, out, fmt)
    return S.sse(chat_chunks(req, rid, model, created, run.gen, fmt, run.prompt_len))


async def chat_chunks(
    req: ChatCompletionRequest,
    rid: str,
    model: str,
    created: int,
    gen: AsyncIterator[RequestOutput],
    fmt: ChatFormat,
    prompt_len: int,
) -> AsyncIterator[dict]:
    """The role chunk, the deltas, then the usage chunk if asked for."""
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    role = {"role": "assistant", "content": ""}
    first = {
        **head,
        "choices": [
            {"index": i, "delta": role, "logprobs": None, "finish_reason": None}
            for i in range(req.n)
        ],
    }
    if fmt.continuous_usage:
        first["usage"] = {
            "prompt_tokens": prompt_len,
            "completion_tokens": 0,
            "total_tokens": prompt_len,
        }
    yield first
    final, sent = None, ChatSent()
    async for out in gen:
        final = out
        chunk = chat_chunk(rid, model, created, out, sent, fmt)
        if chunk:
            yield chunk
    if (last := S.usage_chunk(req, head, [final])) is not None:
        yield last
