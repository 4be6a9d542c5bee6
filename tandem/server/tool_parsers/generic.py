"""Tool calls for a model whose chat template knows no tool-call format (llama.cpp's generic
format): the tools are described in the system prompt and the output is constrained to JSON,
{"tool_calls": [{"name": ..., "arguments": {...}}]} to call them or {"response": "..."} to
answer. A template that cannot show earlier calls and their results gets them in words: the
assistant's "I called get_weather with {...}.", then a user turn "get_weather returned: ..."."""

from __future__ import annotations

import json
from json.decoder import JSONDecodeError, scanstring

from tandem.core.sampling_params import StructuredOutputsParams
from tandem.server.tool_parsers.base import Extracted, ToolParser, call_of, chosen

RESPONSE = '{"response": "'  # how the constrained answer starts (JSON laid out as json.dumps)
_HEX = frozenset("0123456789abcdefABCDEF")
PROMPT = (
    "You can call these tools:\n{tools}\n\nAnswer with a JSON object: "
    '{{"tool_calls": [{{"name": <the tool\'s name>, "arguments": <its arguments>}}]}} '
    "to call tools{answer}."
)
ANSWER = ', or {"response": <your answer>} to answer'


class GenericToolParser(ToolParser):
    name = "generic"

    def __init__(self, renders_tools: bool = False, renders_calls: bool = False) -> None:
        self.renders_tools = renders_tools  # the template shows `tools` itself
        self.renders_calls = renders_calls  # and earlier calls and their results

    def extract(self, text: str, final: bool) -> Extracted:
        if text.startswith(RESPONSE):
            return Extracted(_json_string(text[len(RESPONSE) :]))
        if not final:
            return Extracted()
        try:
            value = json.loads(text)
        except ValueError:
            return Extracted(text)
        items = value.get("tool_calls") if isinstance(value, dict) else None
        calls = [call_of(c) for c in items] if isinstance(items, list) and items else [None]
        return Extracted("", calls) if all(calls) else Extracted(text)

    def prompt(
        self, messages: list[dict], tools: list[dict] | None, choice: str | None
    ) -> tuple[list[dict], list[dict] | None]:
        if not self.renders_calls:
            messages = calls_as_text(messages)
        if tools is None or self.renders_tools:
            return messages, tools
        described = json.dumps(chosen(tools, choice))
        text = PROMPT.format(tools=described, answer="" if choice else ANSWER)
        if messages and messages[0]["role"] == "system":
            first = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
            return [first, *messages[1:]], None
        return [{"role": "system", "content": text}, *messages], None

    def constraint(
        self, tools: list[dict], choice: str | None, parallel: bool
    ) -> StructuredOutputsParams:
        calls = {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    _object({"name": {"const": f["name"]}, "arguments": f.get("parameters") or {}})
                    for f in chosen(tools, choice)
                ]
            },
        }
        if not parallel:
            calls["maxItems"] = 1
        schema = _object({"tool_calls": calls})
        if choice is None:
            schema = {"anyOf": [schema, _object({"response": {"type": "string"}})]}
        return StructuredOutputsParams(json=schema)


def _object(properties: dict) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _json_string(body: str) -> str:
    """The text of a JSON string (its opening quote already read), whole or as far as it has
    come: an escape cut short waits for the rest; the text stops before a bad escape."""
    try:
        return scanstring(body, 0)[0]
    except ValueError:
        pass
    body = body[: _cut_escape(body)]
    try:
        text = scanstring(body + '"', 0)[0]
    except JSONDecodeError as e:  # a bad escape or control character at e.pos
        return _json_string(body[: e.pos]) if 0 <= e.pos < len(body) else ""
    return text[:-1] if text and "\ud800" <= text[-1] <= "\udbff" else text  # half a surrogate pair


def _cut_escape(body: str) -> int:
    """Where an escape cut short at the end of `body` starts (a backslash, or a \\u with fewer
    than 4 hex digits), else len(body). Reads only the end: a stream step stays cheap."""
    end, digits = len(body), 0
    while digits < 4 and digits < end and body[end - 1 - digits] in _HEX:
        digits += 1
    u = end - digits - 1
    if digits < 4 and u > 0 and body[u] == "u" and _odd_backslashes(body, u):
        return u - 1
    return end - 1 if _odd_backslashes(body, end) else end


def _odd_backslashes(body: str, end: int) -> bool:
    """Whether body[:end] ends in an odd run of backslashes: its last one starts an escape."""
    run = 0
    while run < end and body[end - 1 - run] == "\\":
        run += 1
    return run % 2 == 1


def calls_as_text(messages: list[dict]) -> list[dict]:
    """Earlier calls as the assistant's words, their results as user turns (consecutive ones
    merged, for templates that want turns to alternate). Plain words, not the JSON: a small
    model shown its JSON call repeats it instead of answering with the result."""
    out: list[dict] = []
    names: dict[str, str] = {}  # call id -> function name
    for m in messages:
        if m.get("tool_calls"):
            said = []
            for c in m["tool_calls"]:
                names[c.get("id")] = c["function"]["name"]
                said.append(
                    f"I called {c['function']['name']} with "
                    f"{json.dumps(c['function'].get('arguments'))}."
                )
            said = [m["content"], *said] if m.get("content") else said
            m = {"role": m["role"], "content": " ".join(said)}
        elif m["role"] == "tool":
            result = f"{names.get(m.get('tool_call_id'), 'The tool')} returned: {m['content']}"
            if out and out[-1].get("from_tool"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + result}
                continue
            m = {"role": "user", "content": result, "from_tool": True}
        out.append(m)
    return [{k: v for k, v in m.items() if k != "from_tool"} for m in out]
