"""Mistral tool calls (vLLM's `mistral`): [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
(v3 templates), or [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"} (v11 and later).
[TOOL_CALLS] is a special token: the text keeps it (skip_special_tokens off), and a grammar
cannot match it as text, so calls are parsed, not constrained."""

from __future__ import annotations

from tandem.core.sampling_params import StructuredOutputsParams
from tandem.server.tool_parsers.base import ToolCall, ToolParser, call_of, read_json

BEGIN, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = (BEGIN,)
    skip_special_tokens = False

    def read(self, text: str, start: int) -> tuple[list[ToolCall] | None, int] | None:
        pos = start + len(BEGIN)
        if text[pos:].lstrip().startswith("["):
            got = read_json(text, pos)
            if got is None:
                return None
            value, end = got
            calls = [call_of(v) for v in value] if isinstance(value, list) and value else [None]
            return (calls if all(calls) else None), end
        args = text.find(ARGS, pos)
        got = None if args == -1 else read_json(text, args + len(ARGS))
        if got is None:
            return None
        value, end = got
        name = text[pos:args].strip()
        return ([(name, value)] if name and isinstance(value, dict) else None), end

    def constraint(
        self, tools: list[dict], choice: str | None, parallel: bool
    ) -> StructuredOutputsParams | None:
        return None
