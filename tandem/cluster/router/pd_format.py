"""The client's side of a P/D request: the prefill side's first token and the decode side's
completion chunks, reassembled into one ordinary OpenAI response (chat or completions), one id."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import httpx

from tandem.server import responses as R


class PDFormat:
    """Decode-side completion chunks -> the client's API (chat or completions), one id."""

    def __init__(self, model: str, chat: bool, prompt_tokens: int, body: dict) -> None:
        self.model, self.chat, self.prompt_tokens = model, chat, prompt_tokens
        self.rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.completion_tokens = 0
        self.prefill_split: dict = {}  # the prefill side's queue / prefill seconds
        self.decode_start = 0.0

    def chunk(self, text: str, finish: str | None) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        choice = (
            {"index": 0, "delta": {"content": text}} if self.chat else {"index": 0, "text": text}
        )
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [{**choice, "logprobs": None, "finish_reason": finish}],
        }

    def usage_body(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def latency_split(self) -> dict:
        """What a co-located response's `metrics` holds: queue and prefill seconds from the
        prefill side; decode seconds from the decode side being up (its KV received) to the
        last token, across migrations. The KV handoff falls in none of the three."""
        if not self.prefill_split:
            return {}
        return {
            "queue_time": self.prefill_split.get("queue_time", 0.0),
            "prefill_time": self.prefill_split.get("prefill_time", 0.0),
            "decode_time": time.monotonic() - self.decode_start,
        }

    async def pieces(
        self, head: dict, events: AsyncIterator[dict]
    ) -> AsyncIterator[tuple[str, str | None]]:
        """(text, finish_reason) per step; raises RuntimeError (LegFailed) when the decode side
        fails."""
        self.completion_tokens, self.prefill_split = 1, head.get("metrics") or {}
        self.decode_start = time.monotonic()
        yield head["text"], head["finish_reason"]
        async for ev in events:
            if ev.get("usage"):
                self.completion_tokens = ev["usage"][
                    "completion_tokens"
                ]  # every leg's, the first token's too
            for c in ev.get("choices") or ():
                yield c.get("text", ""), c.get("finish_reason")

    async def sse(self, head: dict, events: AsyncIterator[dict]) -> AsyncIterator[str]:
        if self.chat:
            role = self.chunk("", None)
            role["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield R.sse_event(role)
        try:
            async for text, finish in self.pieces(head, events):
                yield R.sse_event(self.chunk(text, finish))
            if self.usage:
                last = {
                    **self.chunk("", None),
                    "choices": [],
                    "usage": self.usage_body(),
                    "metrics": self.latency_split(),
                }
                yield R.sse_event(last)
        except (httpx.HTTPError, RuntimeError) as e:
            msg = (
                f"decode side failed mid-stream ({type(e).__name__}: {e}); "
                "the response is incomplete"
            )
            yield R.error_event(msg, 502)
        yield R.SSE_DONE

    async def body(self, head: dict, events: AsyncIterator[dict]) -> dict:
        text, finish = "", None
        async for piece, fin in self.pieces(head, events):
            text, finish = text + piece, fin or finish
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        return {
            "id": self.rid,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{**choice, "logprobs": None, "finish_reason": finish}],
            "usage": self.usage_body(),
            "metrics": self.latency_split(),
        }
