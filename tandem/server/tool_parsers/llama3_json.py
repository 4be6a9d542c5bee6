"""Llama 3.1 / 3.2 / 3.3 JSON tool calls (vLLM's `llama3_json`):
{"name": "get_weather", "parameters": {"city": "Paris"}}, alone or after <|python_tag|>, several
separated by ";"."""

from __future__ import annotations

import json

from tandem.server.tool_parsers.base import ToolCall, ToolParser, call_of, read_json, schema_tag

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG, '{"name"')
    triggers = ('{"name": ',)

    def read(self, text: str, start: int) -> tuple[list[ToolCall] | None, int] | None:
        tagged = text.startswith(PYTHON_TAG, start)
        got = read_json(text, start + len(PYTHON_TAG) if tagged else start)
        if got is None:
            return None
        value, end = got
        call = None
        if isinstance(value, dict):
            call = call_of(value, "parameters" if "parameters" in value else "arguments")
        while end < len(text) and text[end] in "; \t\n":
            end += 1
        return ([call] if call else None), end

    def tag(self, name: str, parameters: dict) -> dict:
        return schema_tag(f'{{"name": {json.dumps(name)}, "parameters": ', parameters, "}")
