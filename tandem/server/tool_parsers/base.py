"""What every tool-call parser does: split a model's output into its text and its tool calls,
whole or as far as a stream has come, and constrain a call's arguments to its tool's schema
(an xgrammar structural tag: free text until a call starts, then the schema)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tandem.core.sampling_params import StructuredOutputsParams

ToolCall = tuple[str, dict[str, Any]]  # (function name, arguments)


@dataclass(slots=True)
class Extracted:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""  # a reasoning model's, before the answer (reasoning_parser.py)


def call_of(value: Any, arguments_key: str = "arguments") -> ToolCall | None:
    """A call from {"name": ..., arguments_key: {...}} (the arguments may be JSON text); None if
    it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get(arguments_key, {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (value["name"], args) if isinstance(args, dict) else None


def partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that a marker starts with: held back from a
    stream until the next tokens say whether a call begins there."""
    for k in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0


def read_json(text: str, pos: int) -> tuple[Any, int] | None:
    """A JSON value at text[pos:] (after whitespace) and where it ends; None if none is whole."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    try:
        return json.JSONDecoder().raw_decode(text, pos)
    except ValueError:
        return None


class ToolParser:
    """A family whose calls start at a marker (`markers`) and are read by `read`. `extract`
    with final=False is what a stream may send so far: the text before a call that may be
    starting is held back, and a call goes out once whole. With final=True, a call cut short
    or malformed is plain text."""

    name = ""
    markers: tuple[str, ...] = ()  # where a call starts
    triggers: tuple[str, ...] = ()  # what switches the structural tag from free text to a call
    skip_special_tokens = True  # False where a marker is a special token the text must keep

    def read(self, text: str, start: int) -> tuple[list[ToolCall] | None, int] | None:
        """The calls that start at text[start] (a marker) and where they end; (None, end) for a
        malformed one (plain text up to `end`); None while it is not whole."""
        raise NotImplementedError

    def extract(self, text: str, final: bool) -> Extracted:
        out, pos = Extracted(), 0
        while True:
            found = [i for i in (text.find(m, pos) for m in self.markers) if i != -1]
            if not found:
                tail = text[pos:]
                held = 0 if final else partial_marker(tail, self.markers)
                out.content += tail[: len(tail) - held]
                return out
            start = min(found)
            out.content += text[pos:start]
            got = self.read(text, start)
            if got is None:  # not whole: held back, or at the end plain text
                out.content += text[start:] if final else ""
                return out
            calls, pos = got
            if calls is None:
                out.content += text[start:pos]
            else:
                out.calls += calls
                while pos < len(text) and text[pos].isspace():  # the newlines between calls
                    pos += 1

    def prompt(
        self, messages: list[dict], tools: list[dict] | None, choice: str | None
    ) -> tuple[list[dict], list[dict] | None]:
        """The messages and tools the chat template renders: as given, for a family whose
        template knows its own tool format."""
        return messages, tools

    def constraint(
        self, tools: list[dict], choice: str | None, parallel: bool
    ) -> StructuredOutputsParams | None:
        """The output's constraint where it may call `tools` (choice None: it may also answer;
        "required": at least one call; a name: that function's call alone); None where the
        family's markers cannot be matched as text."""
        tags = [self.tag(f["name"], f.get("parameters") or {}) for f in chosen(tools, choice)]
        if choice not in (None, "required"):
            return _structural_tag(tags[0])
        return _structural_tag(
            {
                "type": "triggered_tags",
                "triggers": list(self.triggers),
                "tags": tags,
                "at_least_one": choice == "required",
                "stop_after_first": not parallel,
            }
        )

    def tag(self, name: str, parameters: dict) -> dict:
        """One function's call: begin text, its arguments' schema, end text."""
        raise NotImplementedError


def chosen(tools: list[dict], choice: str | None) -> list[dict]:
    """The functions the output may call: all, or the one named."""
    return [t["function"] for t in tools if choice in (None, "required", t["function"]["name"])]


def _structural_tag(fmt: dict) -> StructuredOutputsParams:
    tag = {"type": "structural_tag", "format": fmt}
    return StructuredOutputsParams(structural_tag=json.dumps(tag))


def schema_tag(begin: str, parameters: dict, end: str) -> dict:
    return {
        "type": "tag",
        "begin": begin,
        "end": end,
        "content": {"type": "json_schema", "json_schema": parameters},
    }
