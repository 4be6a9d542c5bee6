"""OpenAI-shaped response bodies and stream chunks built from RequestOutputs."""
from __future__ import annotations

import json

from tandem.engine.output_processor import CompletionOutput, RequestOutput
from tandem.server.metrics import request_timings
from tandem.server.tool_calls import ToolCallPlan, parse_tool_calls


SSE_DONE = "data: [DONE]\n\n"


def sse_event(obj: dict) -> str:
    """One server-sent event carrying `obj` as JSON (stream chunks, and errors mid-stream)."""
    return f"data: {json.dumps(obj)}\n\n"


def error_event(message: str, code: int = 500, type_: str = "server_error") -> str:
    """The OpenAI-style error object as the last event of a stream that could not finish."""
    return sse_event({"error": {"message": message, "type": type_, "param": None, "code": code}})


def usage(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.metrics.num_cached_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def latency_split(outs: list[RequestOutput]) -> dict:
    """Queue / prefill / decode seconds (of the slowest request): lets a load tester place
    a bottleneck without scraping /metrics."""
    timings = [request_timings(o) for o in outs if o.finished]
    if not timings:
        return {}
    worst = max(timings, key=lambda t: t["e2e"])
    return {k: worst[k] for k in ("queue_time", "prefill_time", "decode_time")}


def _logprob(lp: float) -> float:
    """A token masked out by a grammar has logprob -inf, which JSON cannot carry: -9999 (as vLLM)."""
    return max(lp, -9999.0)


def _token_str(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def completion_logprobs(tokenizer, entries: list[list[tuple[int, float]]], offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for entry in entries:
        text = _token_str(tokenizer, entry[0][0])
        tokens.append(text)
        token_lps.append(_logprob(entry[0][1]))
        tops.append({_token_str(tokenizer, t): _logprob(lp) for t, lp in entry[1:]} or None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, entries: list[list[tuple[int, float]]]) -> dict:
    def item(t: int, lp: float) -> dict:
        s = _token_str(tokenizer, t)
        return {"token": s, "logprob": _logprob(lp), "bytes": list(s.encode())}
    return {"content": [{**item(*e[0]), "top_logprobs": [item(t, lp) for t, lp in e[1:]]} for e in entries]}


def _choice_index(prompt_index: int, n: int, c: CompletionOutput) -> int:
    return prompt_index * n + c.index


def completion_body(rid: str, model: str, created: int, outs: list[RequestOutput], n: int,
                    want_logprobs: bool, tokenizer) -> dict:
    choices = []
    for i, out in enumerate(outs):
        for c in out.outputs:
            choices.append({
                "index": _choice_index(i, n, c), "text": c.text,
                "logprobs": completion_logprobs(tokenizer, c.logprobs or [], 0) if want_logprobs else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            })
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(outs), "metrics": latency_split(outs)}


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


def chat_body(rid: str, model: str, created: int, out: RequestOutput, want_logprobs: bool, tokenizer,
              tools: ToolCallPlan | None = None) -> dict:
    choices = []
    for c in out.outputs:
        message, finish_reason = _message(c, tools)
        choices.append({
            "index": c.index, "message": message,
            "logprobs": chat_logprobs(tokenizer, c.logprobs or []) if want_logprobs else None,
            "finish_reason": finish_reason, "stop_reason": c.stop_reason,
        })
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage([out]), "metrics": latency_split([out])}


def _news(out: RequestOutput, finish_sent: set[int]) -> list[CompletionOutput]:
    """Choices with new text, or a finish not reported yet (siblings finish at different steps)."""
    news = []
    for c in out.outputs:
        if c.delta_token_ids or c.delta_text or (c.finished and c.index not in finish_sent):
            if c.finished:
                finish_sent.add(c.index)
            news.append(c)
    return news


def completion_chunk(rid: str, model: str, created: int, prompt_index: int, n: int, out: RequestOutput,
                     finish_sent: set[int], want_logprobs: bool, tokenizer) -> dict | None:
    choices = []
    for c in _news(out, finish_sent):
        lps = None
        if want_logprobs and c.logprobs is not None:
            lps = completion_logprobs(tokenizer, c.logprobs[len(c.logprobs) - len(c.delta_token_ids):],
                                      len(c.text) - len(c.delta_text))
        choices.append({"index": _choice_index(prompt_index, n, c), "text": c.delta_text, "logprobs": lps,
                        "finish_reason": c.finish_reason if c.finished else None})
    if not choices:
        return None
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}


def chat_chunk(rid: str, model: str, created: int, out: RequestOutput, finish_sent: set[int],
               want_logprobs: bool, tokenizer, tools: ToolCallPlan | None = None) -> dict | None:
    choices = []
    for c in _news(out, finish_sent):
        delta, finish_reason = {"content": c.delta_text}, c.finish_reason if c.finished else None
        lps = None
        if want_logprobs and c.logprobs is not None:
            lps = chat_logprobs(tokenizer, c.logprobs[len(c.logprobs) - len(c.delta_token_ids):])
        if tools is not None:
            # Tool calls go out whole when the choice ends (their arguments must parse first);
            # an output cut short goes out as its text.
            if not c.finished:
                continue
            message, finish_reason = _message(c, tools)
            delta = ({"tool_calls": [{"index": j, **call} for j, call in enumerate(message["tool_calls"])]}
                     if finish_reason == "tool_calls" else {"content": c.text})
        choices.append({"index": c.index, "delta": delta, "logprobs": lps, "finish_reason": finish_reason})
    if not choices:
        return None
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
