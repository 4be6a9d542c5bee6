"""The chat API's response bodies and stream chunks, built from RequestOutputs: the text, or
with tools the text and the calls the family parser reads from it (streamed as each call
completes, as vLLM's tool-call deltas)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.output_processor import CompletionOutput, RequestOutput
from tandem.server.reasoning_parser import ThinkParser
from tandem.server.responses import (
    Sent,
    Tokens,
    chat_logprobs,
    latency_split,
    news,
    prompt_logprobs,
    usage,
)
from tandem.server.tool_calls import Progress, ToolCallPlan, openai_call, read_output


@dataclass(slots=True)
class ChatFormat:
    """What a chat request asks of its answer's shape."""

    tokens: Tokens
    logprobs: bool
    tools: ToolCallPlan | None = None
    think: ThinkParser | None = None
    prompt_logprobs: int | None = None
    continuous_usage: bool = False


@dataclass(slots=True)
class ChatSent(Sent):
    """Per choice, how much of its reasoning, text and calls and of its tokens' logprobs the
    stream has sent (a token whose text is held back sends its logprob with the next chunk)."""

    progress: dict[int, Progress] = field(default_factory=dict)
    logprobs: dict[int, int] = field(default_factory=dict)


def _message(c: CompletionOutput, fmt: ChatFormat) -> tuple[dict, str | None]:
    """(message, finish_reason): a reasoning model's reasoning as reasoning_content; with
    tools, the calls read from the text (finish_reason "tool_calls"), and the text around
    them as content."""
    got = read_output(c.text, fmt.tools, True, fmt.think)
    message = {"role": "assistant", "content": got.content}
    if fmt.think is not None:
        message["reasoning_content"] = got.reasoning or None
    if not got.calls:
        return message, c.finish_reason
    message["content"] = got.content or None
    return {**message, "tool_calls": [openai_call(call) for call in got.calls]}, "tool_calls"


def chat_body(rid: str, model: str, created: int, out: RequestOutput, fmt: ChatFormat) -> dict:
    choices = []
    for c in out.outputs:
        message, finish_reason = _message(c, fmt)
        choices.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": chat_logprobs(fmt.tokens, c.logprobs or []) if fmt.logprobs else None,
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
            }
        )
    body = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage([out]),
        "metrics": latency_split([out]),
    }
    if fmt.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs(fmt.tokens, out, fmt.prompt_logprobs)
    return body


def _delta(c: CompletionOutput, fmt: ChatFormat, sent: ChatSent) -> dict:
    """What the choice's stream has not sent yet: its new reasoning and text, and its calls
    that completed."""
    if fmt.tools is None and fmt.think is None:
        return {"content": c.delta_text}
    progress = sent.progress.setdefault(c.index, Progress())
    calls = progress.calls
    new = progress.news(read_output(c.text, fmt.tools, c.finished, fmt.think))
    delta = {"reasoning_content": new.reasoning} if new.reasoning else {}
    if new.content:
        delta["content"] = new.content
    if new.calls:
        delta["tool_calls"] = [
            {"index": calls + j, **openai_call(call)} for j, call in enumerate(new.calls)
        ]
    return delta


def chat_chunk(
    rid: str, model: str, created: int, out: RequestOutput, sent: ChatSent, fmt: ChatFormat
) -> dict | None:
    choices = []
    for c in news(out, sent):
        delta = _delta(c, fmt, sent)
        finish = None
        if c.finished:
            called = sent.progress.get(c.index, Progress()).calls
            finish = "tool_calls" if called else c.finish_reason
        elif not delta:
            continue
        lps = None
        if fmt.logprobs and c.logprobs is not None:
            lps = chat_logprobs(fmt.tokens, c.logprobs[sent.logprobs.get(c.index, 0) :])
            sent.logprobs[c.index] = len(c.logprobs)
        choices.append({"index": c.index, "delta": delta, "logprobs": lps, "finish_reason": finish})
    if not choices:
        return None
    chunk = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if fmt.continuous_usage:
        chunk["usage"] = usage([out])
    return chunk
