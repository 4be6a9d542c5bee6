"""OpenAI-shaped response pieces built from RequestOutputs: SSE events, usage, logprobs (of the
output, of the prompt, and both under completions' `echo`), and the completions API's bodies and
stream chunks. The chat API's are in chat_responses.py."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.output_processor import CompletionOutput, RequestOutput
from tandem.server.metrics import request_timings

SSE_DONE = "data: [DONE]\n\n"
# A token and its logprob (None: the prompt's first token), then the top alternatives
Entry = list[tuple[int, float | None]]


def sse_event(obj: dict) -> str:
    """One server-sent event carrying `obj` as JSON (stream chunks, and errors mid-stream)."""
    return f"data: {json.dumps(obj)}\n\n"


def error_event(message: str, code: int = 500, type_: str = "server_error") -> str:
    """The OpenAI-style error object as the last event of a stream that could not finish."""
    return sse_event({"error": {"message": message, "type": type_, "param": None, "code": code}})


def token_counts(outs: list[RequestOutput]) -> tuple[int, int, int]:
    """(prompt, output, cached prompt) tokens of the requests: each API's usage, in its names."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    output = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return prompt, output, sum(o.metrics.num_cached_tokens for o in outs)


def usage(outs: list[RequestOutput]) -> dict:
    prompt, completion, cached = token_counts(outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def latency_split(outs: list[RequestOutput]) -> dict:
    """Queue / prefill / decode seconds (of the slowest request): lets a load tester place
    a bottleneck without scraping /metrics."""
    timings = [request_timings(o) for o in outs if o.finished]
    if not timings:
        return {}
    worst = max(timings, key=lambda t: t["e2e"])
    return {k: worst[k] for k in ("queue_time", "prefill_time", "decode_time")}


def _logprob(lp: float) -> float:
    """A token masked out by a grammar has logprob -inf, which JSON cannot carry: -9999 (as
    vLLM)."""
    return max(lp, -9999.0)


@dataclass(slots=True)
class Tokens:
    """How logprobs name tokens: their text, or `token_id:N` (vLLM's return_tokens_as_token_ids)."""

    tokenizer: Any
    as_ids: bool = False

    def __call__(self, token_id: int) -> str:
        if self.as_ids or self.tokenizer is None:
            return f"token_id:{token_id}" if self.as_ids else str(token_id)
        return self.tokenizer.decode([token_id])


def completion_logprobs(tokens: Tokens, entries: list[Entry], offset: int) -> dict:
    texts, lps, tops, offsets = [], [], [], []
    for entry in entries:
        text, lp = tokens(entry[0][0]), entry[0][1]
        texts.append(text)
        lps.append(None if lp is None else _logprob(lp))
        tops.append(None if lp is None else {tokens(t): _logprob(v) for t, v in entry[1:]} or None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokens: Tokens, entries: list[Entry]) -> dict:
    def item(t: int, lp: float) -> dict:
        s = tokens(t)
        return {"token": s, "logprob": _logprob(lp), "bytes": list(s.encode())}

    return {
        "content": [
            {**item(*e[0]), "top_logprobs": [item(t, lp) for t, lp in e[1:]]} for e in entries
        ]
    }


def prompt_logprobs(tokens: Tokens, out: RequestOutput, k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then per token {id: {logprob, rank,
    decoded_token}} for it and its k alternatives (its rank when it is one of them)."""
    result: list[dict | None] = [None]
    for entry in out.prompt_logprobs or []:
        top = entry[1 : 1 + k]
        ranks = {t: i + 1 for i, (t, _) in enumerate(top)}
        result.append(
            {
                str(t): {"logprob": _logprob(lp), "rank": ranks.get(t), "decoded_token": tokens(t)}
                for t, lp in [entry[0], *top]
            }
        )
    return result


@dataclass(slots=True)
class CompletionFormat:
    """What a completions request asks of its answer's shape."""

    n: int
    tokens: Tokens
    logprobs: int | None  # alternatives per token; None: no logprobs
    echo: list[str] | None = None  # the prompts' texts, to go before the outputs
    prompt_logprobs: int | None = None
    continuous_usage: bool = False

    def echo_entries(self, out: RequestOutput) -> list[Entry]:
        """The prompt's tokens as logprobs entries, cut to the request's alternatives."""
        k = self.logprobs or 0
        return [[(out.prompt_token_ids[0], None)]] + [e[: 1 + k] for e in out.prompt_logprobs or []]


def _choice(
    i: int,
    out: RequestOutput,
    c: CompletionOutput,
    fmt: CompletionFormat,
    text: str,
    entries: list[Entry] | None,
    offset: int,
    first: bool,
) -> dict:
    """A choice, or its stream chunk: `text` from `offset` in the output; `first`: the choice's
    first (where an echoed prompt and the prompt's logprobs go)."""
    choice = {"index": i * fmt.n + c.index, "text": text, "logprobs": None}
    if fmt.echo is not None:
        if first:
            choice["text"] = fmt.echo[i] + text
            if fmt.logprobs is not None:
                entries = fmt.echo_entries(out) + (entries or [])
        else:
            offset += len(fmt.echo[i])
    if fmt.logprobs is not None and entries is not None:
        choice["logprobs"] = completion_logprobs(fmt.tokens, entries, 0 if first else offset)
    if fmt.prompt_logprobs is not None and first:
        choice["prompt_logprobs"] = prompt_logprobs(fmt.tokens, out, fmt.prompt_logprobs)
    return choice


def completion_body(
    rid: str, model: str, created: int, outs: list[RequestOutput], fmt: CompletionFormat
) -> dict:
    choices = []
    for i, out in enumerate(outs):
        for c in out.outputs:
            choice = _choice(i, out, c, fmt, c.text, c.logprobs or [], 0, True)
            choices.append(
                {**choice, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            )
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(outs),
        "metrics": latency_split(outs),
    }


@dataclass(slots=True)
class Sent:
    """Of one request's stream: the choices that had a chunk, and those whose finish went out."""

    started: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)


def news(out: RequestOutput, sent: Sent) -> list[CompletionOutput]:
    """Choices with new text, or a finish not reported yet (siblings finish at different steps)."""
    found = []
    for c in out.outputs:
        if c.delta_token_ids or c.delta_text or (c.finished and c.index not in sent.finished):
            if c.finished:
                sent.finished.add(c.index)
            found.append(c)
    return found


def completion_chunk(
    rid: str,
    model: str,
    created: int,
    prompt_index: int,
    out: RequestOutput,
    sent: Sent,
    fmt: CompletionFormat,
) -> dict | None:
    choices = []
    for c in news(out, sent):
        entries = None
        if c.logprobs is not None:
            entries = c.logprobs[len(c.logprobs) - len(c.delta_token_ids) :]
        first = c.index not in sent.started
        sent.started.add(c.index)
        offset = len(c.text) - len(c.delta_text)
        choice = _choice(prompt_index, out, c, fmt, c.delta_text, entries, offset, first)
        choices.append({**choice, "finish_reason": c.finish_reason if c.finished else None})
    if not choices:
        return None
    chunk = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if fmt.continuous_usage:
        chunk["usage"] = usage([out])
    return chunk
