"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens: the request
runs as the chat request it means (routes/chat.py), and its output comes back as Anthropic's
content blocks (text, tool_use), stop_reason and usage, whole or as Anthropic's stream events."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tandem.engine.output_processor import CompletionOutput, RequestOutput
from tandem.server import responses as R
from tandem.server import serving as S
from tandem.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from tandem.server.errors import APIError
from tandem.server.protocol import ChatCompletionRequest
from tandem.server.routes.chat import ChatRun, render_prompt, start_chat
from tandem.server.state import serving_state
from tandem.server.tool_calls import Progress, read_output

router = APIRouter()


def chat_request(req: CountTokensRequest, **fields) -> ChatCompletionRequest:
    try:
        return req.chat_request(**fields)
    except ValueError as e:
        raise APIError(400, str(e).removeprefix("Value error, "), param="messages") from None


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: CountTokensRequest, request: Request):
    state = serving_state(request)
    chat = chat_request(req)
    S.check_admission(state, chat.model, 1)
    return {"input_tokens": len(S.encode(state, render_prompt(state, chat)))}


@router.post("/v1/messages")
async def create_message(req: MessagesRequest, request: Request):
    rid = f"msg_{uuid.uuid4().hex}"
    run = await start_chat(chat_request(req, **req.sampling()), request, rid)
    model = serving_state(request).config.model_name
    if not req.stream:
        out = (await S.collect(request, [run.gen]))[0]
        return message_body(rid, model, out, run)
    return StreamingResponse(events(rid, model, run), media_type="text/event-stream")


def _tool_use(name: str, arguments: dict, input_: dict | None = None) -> dict:
    return {
        "type": "tool_use",
        "id": f"toolu_{uuid.uuid4().hex[:24]}",
        "name": name,
        "input": arguments if input_ is None else input_,
    }


def _stop(c: CompletionOutput, called: bool) -> dict:
    """stop_reason and stop_sequence: Anthropic's names for how the output ended."""
    if called:
        reason = "tool_use"
    elif c.finish_reason == "length":
        reason = "max_tokens"
    else:
        reason = "stop_sequence" if isinstance(c.stop_reason, str) else "end_turn"
    sequence = c.stop_reason if reason == "stop_sequence" else None
    return {"stop_reason": reason, "stop_sequence": sequence}


def _thinking(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}


def message_body(rid: str, model: str, out: RequestOutput, run: ChatRun) -> dict:
    c = out.outputs[0]
    got = read_output(c.text, run.tools, True, run.think)
    content = [_thinking(got.reasoning)] if got.reasoning else []
    content += [{"type": "text", "text": got.content}] if got.content else []
    content += [_tool_use(name, args) for name, args in got.calls]
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        **_stop(c, bool(got.calls)),
        "usage": _usage(out),
    }


def _usage(out: RequestOutput) -> dict:
    prompt, output, _ = R.token_counts([out])
    return {"input_tokens": prompt, "output_tokens": output}


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"


async def events(rid: str, model: str, run: ChatRun) -> AsyncIterator[str]:
    """message_start; per block content_block_start, its deltas, content_block_stop (thinking
    and text blocks as their text comes, a tool_use block as each call completes);
    message_delta with the stop_reason and usage; message_stop. An error after the start is an
    `error` event."""
    yield _event(
        "message_start",
        {
            "message": {
                "id": rid,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": run.prompt_len, "output_tokens": 0},
            }
        },
    )
    index, open_, progress, out = 0, None, Progress(), None
    try:
        async for out in run.gen:
            c = out.outputs[0]
            new = progress.news(read_output(c.text, run.tools, c.finished, run.think))
            for kind, text in (("thinking", new.reasoning), ("text", new.content)):
                if not text:
                    continue
                if open_ != kind:
                    if open_ is not None:
                        yield _event("content_block_stop", {"index": index})
                        index += 1
                    block = _thinking("") if kind == "thinking" else {"type": "text", "text": ""}
                    yield _event("content_block_start", {"index": index, "content_block": block})
                    open_ = kind
                delta = {"type": f"{kind}_delta", kind: text}
                yield _event("content_block_delta", {"index": index, "delta": delta})
            for name, args in new.calls:
                if open_ is not None:
                    yield _event("content_block_stop", {"index": index})
                    index, open_ = index + 1, None
                block = _tool_use(name, args, {})
                yield _event("content_block_start", {"index": index, "content_block": block})
                delta = {"type": "input_json_delta", "partial_json": json.dumps(args)}
                yield _event("content_block_delta", {"index": index, "delta": delta})
                yield _event("content_block_stop", {"index": index})
                index += 1
        if open_ is not None:
            yield _event("content_block_stop", {"index": index})
        yield _event(
            "message_delta",
            {"delta": _stop(out.outputs[0], progress.calls > 0), "usage": _usage(out)},
        )
        yield _event("message_stop", {})
    except (APIError, RuntimeError) as e:
        message = e.message if isinstance(e, APIError) else str(e)
        yield _event("error", {"error": {"type": "api_error", "message": message}})
