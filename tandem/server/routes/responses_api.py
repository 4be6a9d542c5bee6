"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}: the request
runs as the chat request it means (routes/chat.py) after the stored conversation of
previous_response_id; its output comes back as output items (a message, function calls), whole
or as the typed event stream, and is stored unless `store` is false (response_store.py)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tandem.engine.output_processor import CompletionOutput, RequestOutput
from tandem.server import serving as S
from tandem.server.auth import presented_key
from tandem.server.errors import APIError
from tandem.server.protocol_parts import tool_call
from tandem.server.responses import Tokens, chat_logprobs, token_counts
from tandem.server.responses_protocol import ResponsesRequest
from tandem.server.routes.chat import ChatRun, start_chat
from tandem.server.state import serving_state
from tandem.server.tool_calls import Progress, read_output

router = APIRouter()
TEXT = {"format": {"type": "text"}}
NOT_FOUND = "no response {} here (responses are kept a bounded time, for the key that made them)"


class Answer:
    """One response being answered: its request, its output items as they complete, and the
    conversation it leaves for a next response."""

    def __init__(self, req: ResponsesRequest, request: Request, history: list[dict]) -> None:
        self.req, self.history = req, history
        self.state, self.key = serving_state(request), presented_key(request)
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.tokens = Tokens(self.state.facts.tokenizer)

    def body(self, status: str, items: list[dict], out: RequestOutput | None = None) -> dict:
        """The response object: the request's settings, the output items, and once it has
        finished its usage and whether it was cut short."""
        req = self.req
        effort = req.reasoning.effort if req.reasoning else None
        choice = req.tool_choice or "auto"
        body = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.state.config.model_name,
            "output": items,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "store": req.store,
            "reasoning": {"effort": effort, "summary": None},
            "temperature": req.temperature,
            "text": req.text.model_dump(by_alias=True) if req.text else TEXT,
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "top_p": req.top_p,
            "tools": [t.model_dump() for t in req.tools or []],
            "truncation": "disabled",
            "metadata": req.metadata or {},
            "user": req.user,
            "usage": None,
        }
        if out is not None:
            if out.outputs[0].finish_reason == "length":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
            body["usage"] = self.usage(out, _reasoning(items))
        return body

    def usage(self, out: RequestOutput, thought: str) -> dict:
        """The token counts; the reasoning's as its text encodes (the output's tokens are not
        split at </think>)."""
        prompt, output, cached = token_counts([out])
        tokenizer = self.state.facts.tokenizer
        reasoning = 0
        if thought and tokenizer is not None:
            reasoning = len(tokenizer.encode(thought, add_special_tokens=False))
        return {
            "input_tokens": prompt,
            "output_tokens": output,
            "total_tokens": prompt + output,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens_details": {"reasoning_tokens": reasoning},
        }

    def message(self, text: str, status: str, c: CompletionOutput | None = None) -> dict:
        logprobs = []
        if c is not None and self.req.top_logprobs is not None:
            logprobs = chat_logprobs(self.tokens, c.logprobs or [])["content"]
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
        return {
            "type": "message",
            "id": f"msg_{uuid.uuid4().hex}",
            "status": status,
            "role": "assistant",
            "content": [part],
        }

    def finish(self, out: RequestOutput, items: list[dict], messages: list[dict]) -> dict:
        """The final body, kept (with the conversation) unless store is false; one too large
        for the store says store false."""
        c = out.outputs[0]
        body = self.body("incomplete" if c.finish_reason == "length" else "completed", items, out)
        if self.req.store:
            calls = [
                tool_call(i["call_id"], i["name"], i["arguments"])
                for i in items
                if i["type"] == "function_call"
            ]
            text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
            turn = {"role": "assistant", "content": text or None}
            if calls:
                turn["tool_calls"] = calls
            if thought := _reasoning(items):
                turn["reasoning_content"] = thought
            if not self.state.responses.put(self.key, body, [*self.history, *messages, turn]):
                body["store"] = False
        return body


def _reasoning(items: list[dict]) -> str:
    return "".join(p["text"] for i in items if i["type"] == "reasoning" for p in i["content"])


def reasoning_item(text: str) -> dict:
    return {
        "type": "reasoning",
        "id": f"rs_{uuid.uuid4().hex}",
        "summary": [],
        "status": "completed",
        "content": [{"type": "reasoning_text", "text": text}],
    }


def function_call(name: str, arguments: dict, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "status": status,
        "call_id": f"call_{uuid.uuid4().hex[:24]}",
        "name": name,
        "arguments": json.dumps(arguments),
    }


@router.post("/v1/responses")
async def create_response(req: ResponsesRequest, request: Request):
    state = serving_state(request)
    history: list[dict] = []
    if req.previous_response_id is not None:
        previous = state.responses.get(presented_key(request), req.previous_response_id)
        if previous is None:
            raise APIError(
                404,
                NOT_FOUND.format(req.previous_response_id),
                "not_found_error",
                "previous_response_id",
            )
        history = previous.messages
    answer = Answer(req, request, history)
    try:
        chat = req.chat_request(history)
    except ValueError as e:
        raise APIError(400, str(e).removeprefix("Value error, "), param="input") from None
    run = await start_chat(chat, request, answer.id)
    if req.stream:
        return StreamingResponse(events(answer, run), media_type="text/event-stream")
    out = (await S.collect(request, [run.gen]))[0]
    c = out.outputs[0]
    got = read_output(c.text, run.tools, True, run.think)
    items = [reasoning_item(got.reasoning)] if got.reasoning else []
    items += [answer.message(got.content, "completed", c)] if got.content or not got.calls else []
    items += [function_call(name, args) for name, args in got.calls]
    return answer.finish(out, items, req.messages())


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    entry = serving_state(request).responses.get(presented_key(request), response_id)
    if entry is None:
        raise APIError(404, NOT_FOUND.format(response_id), "not_found_error")
    return entry.body


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    if not serving_state(request).responses.delete(presented_key(request), response_id):
        raise APIError(404, NOT_FOUND.format(response_id), "not_found_error")
    return {"id": response_id, "object": "response", "deleted": True}


async def events(answer: Answer, run: ChatRun) -> AsyncIterator[str]:
    """response.created / in_progress; per item output_item.added, its parts and deltas,
    output_item.done (reasoning when it ends, the message as its text comes, each function
    call as it completes);
    response.completed (or incomplete) with the whole response. An error: an `error` event."""
    seq = iter(range(1 << 62))

    def event(kind: str, /, **data) -> str:
        data = {"type": kind, "sequence_number": next(seq), **data}
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    yield event("response.created", response=answer.body("in_progress", []))
    yield event("response.in_progress", response=answer.body("in_progress", []))
    items: list[dict] = []
    progress, text, message, out = Progress(), "", None, None  # text: the open message's
    try:
        async for out in run.gen:
            c = out.outputs[0]
            got = read_output(c.text, run.tools, c.finished, run.think)
            if got.reasoning and not items and (got.content or got.calls or c.finished):
                item = reasoning_item(got.reasoning)
                for line in _reasoning_events(event, item):
                    yield line
                items.append(item)
            new = progress.news(got)
            if new.content:
                where = {"output_index": len(items)}
                if message is None:
                    message, text = answer.message("", "in_progress"), ""
                    yield event("response.output_item.added", **where, item=message)
                    yield event(
                        "response.content_part.added",
                        item_id=message["id"],
                        **where,
                        content_index=0,
                        part=message["content"][0],
                    )
                yield event(
                    "response.output_text.delta",
                    item_id=message["id"],
                    **where,
                    content_index=0,
                    delta=new.content,
                    logprobs=[],
                )
                text += new.content
            for name, args in new.calls:
                if message is not None:
                    for line in _message_done(event, answer, message, text, items, c):
                        yield line
                    message = None
                call = function_call(name, args)
                yield event(
                    "response.output_item.added",
                    output_index=len(items),
                    item={**call, "arguments": "", "status": "in_progress"},
                )
                yield event(
                    "response.function_call_arguments.delta",
                    item_id=call["id"],
                    output_index=len(items),
                    delta=call["arguments"],
                )
                yield event(
                    "response.function_call_arguments.done",
                    item_id=call["id"],
                    output_index=len(items),
                    arguments=call["arguments"],
                    name=name,
                )
                yield event("response.output_item.done", output_index=len(items), item=call)
                items.append(call)
        if message is None and not items:  # no text, no call: an empty message all the same
            message = answer.message("", "in_progress")
            yield event("response.output_item.added", output_index=0, item=message)
            yield event(
                "response.content_part.added",
                item_id=message["id"],
                output_index=0,
                content_index=0,
                part=message["content"][0],
            )
        if message is not None:
            for line in _message_done(event, answer, message, text, items, out.outputs[0]):
                yield line
        body = answer.finish(out, items, answer.req.messages())
        yield event(f"response.{body['status']}", response=body)
    except (APIError, RuntimeError) as e:
        message_ = e.message if isinstance(e, APIError) else str(e)
        yield event("error", code=None, message=message_, param=None)


def _reasoning_events(event, item: dict) -> list[str]:
    """A reasoning item, whole once the reasoning has ended."""
    where = {"item_id": item["id"], "output_index": 0, "content_index": 0}
    text = item["content"][0]["text"]
    return [
        event("response.output_item.added", output_index=0, item={**item, "content": []}),
        event("response.reasoning_text.delta", **where, delta=text),
        event("response.reasoning_text.done", **where, text=text),
        event("response.output_item.done", output_index=0, item=item),
    ]


def _message_done(
    event, answer: Answer, message: dict, text: str, items: list[dict], c: CompletionOutput
) -> list[str]:
    done = answer.message(text, "completed", c)
    done["id"] = message["id"]
    index = len(items)
    items.append(done)
    where = {"item_id": done["id"], "output_index": index, "content_index": 0}
    return [
        event(
            "response.output_text.done", **where, text=text, logprobs=done["content"][0]["logprobs"]
        ),
        event("response.content_part.done", **where, part=done["content"][0]),
        event("response.output_item.done", output_index=index, item=done),
    ]
