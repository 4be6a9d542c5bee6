"""The chat API's response bodies and stream chunks, built from RequestOutputs."""
from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.output_processor import CompletionOutput, RequestOutput
from tandem.server.responses import (Sent, Tokens, chat_logprobs, latency_split, news,
                                     prompt_logprobs, usage)
from tandem.server.tool_calls import ToolCallPlan, parse_tool_calls


@dataclass(slots=True)
class ChatFormat:
    """What a chat request asks of its answer's shape."""

    tokens: Tokens
    logprobs: bool
    tools: ToolCallPlan | None = None
    prompt_logprobs: int | None = None
    continuous_usage: bool = False


def _tool_calls(c: CompletionOutput, tools: ToolCallPlan | None) -> list[dict] | None:
    """The choice's tool calls, when it asked for them and its output ended whole."""
    if tools is None or c.finish_reason != "stop":
        return None
    return parse_tool_calls(tools, c.text)


def _message(c: CompletionOutput, tools: ToolCallPlan | None) -> tuple[dict, str | None]:
    """(message, finish_reason): tool calls replace the content; an output cut short by
    max_tokens stays text, with finish_reason "length"."""
    calls = _tool_calls(c, tools)
    if calls is None:
        return {"role": "assistant", "content": c.text}, c.finish_reason
    return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"


def chat_body(rid: str, model: str, created: int, out: RequestOutput, fmt: ChatFormat) -> dict:
    choices = []
    for c in out.outputs:
        message, finish_reason = _message(c, fmt.tools)
        choices.append({
            "index": c.index, "message": message,
            "logprobs": chat_logprobs(fmt.tokens, c.logprobs or []) if fmt.logprobs else None,
            "finish_reason": finish_reason, "stop_reason": c.stop_reason,
        })
    body = {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage([out]), "metrics": latency_split([out])}
    if fmt.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs(fmt.tokens, out, fmt.prompt_logprobs)
    return body


def chat_chunk(rid: str, model: str, created: int, out: RequestOutput, sent: Sent,
               fmt: ChatFormat) -> dict | None:
    choices = []
    for c in news(out, sent):
        delta, finish_reason = {"content": c.delta_text}, c.finish_reason if c.finished else None
        lps = None
        if fmt.logprobs and c.logprobs is not None:
            lps = chat_logprobs(fmt.tokens, c.logprobs[len(c.logprobs) - len(c.delta_token_ids):])
        if fmt.tools is not None:
            # Tool calls go out whole when the choice ends (their arguments must parse first);
            # an output cut short goes out as its text.
            if not c.finished:
                continue
            message, finish_reason = _message(c, fmt.tools)
            calls = message.get("tool_calls")
            delta = ({"tool_calls": [{"index": j, **call} for j, call in enumerate(calls)]}
                     if finish_reason == "tool_calls" else {"content": c.text})
        choices.append({"index": c.index, "delta": delta, "logprobs": lps,
                        "finish_reason": finish_reason})
    if not choices:
        return None
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": choices}
    if fmt.continuous_usage:
        chunk["usage"] = usage([out])
    return chunk
