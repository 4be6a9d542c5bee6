"""Hermes / Qwen 2.5 / Qwen 3 tool calls (vLLM's `hermes`):
<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>, after any
text, one block per call."""

from __future__ import annotations

import json

from tandem.server.tool_parsers.base import ToolCall, ToolParser, call_of, schema_tag

BEGIN, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = triggers = (BEGIN,)

    def read(self, text: str, start: int) -> tuple[list[ToolCall] | None, int] | None:
        end = text.find(END, start)
        if end == -1:
            return None
        try:
            call = call_of(json.loads(text[start + len(BEGIN) : end]))
        except ValueError:
            call = None
        return ([call] if call else None), end + len(END)

    def tag(self, name: str, parameters: dict) -> dict:
        begin = f'{BEGIN}\n{{"name": {json.dumps(name)}, "arguments": '
        return schema_tag(begin, parameters, f"}}\n{END}")
