"""Tool calls by forced schema: with `tool_choice` "required" or a named function, the output is
constrained to JSON of the tools' arguments and read back as OpenAI `tool_calls`.

`tool_choice: "none"` ignores `tools`. `"auto"` (the default when tools are given) would need a
parser for the model family's own tool-call format, and no served model has one here
(SmolLM2-Instruct's chat template defines none), so it is refused with the options that work.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from tandem.core.sampling_params import StructuredOutputsParams
from tandem.server.protocol import ChatCompletionRequest

AUTO_REFUSED = ("tool_choice 'auto' (the default when `tools` are given) needs a tool-call parser for the "
                "model's own tool format, and this server has none for this model; use tool_choice "
                "'required' or {\"type\": \"function\", \"function\": {\"name\": ...}} (the output is then "
                "forced to the tools' argument schema), or 'none'")


@dataclass(slots=True)
class ToolCallPlan:
    """How a request's output becomes tool calls: one named function (the output is its
    arguments), or a list of {name, parameters} over all tools ("required")."""

    constraint: StructuredOutputsParams
    function: str | None  # the named function; None for "required"


def plan_tool_calls(req: ChatCompletionRequest) -> ToolCallPlan | None:
    """None when the request calls no tools; ValueError (a 400) for a choice we cannot serve."""
    if req.tool_choice == "none":
        return None
    if not req.tools:
        if req.tool_choice is not None:  # OpenAI refuses it too: there is nothing to call
            raise ValueError("tool_choice needs `tools`: this request gives none")
        return None
    if req.tool_choice in (None, "auto"):
        raise ValueError(AUTO_REFUSED)
    tools = {t.function.name: t.function for t in req.tools}
    if req.tool_choice == "required":
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": name}, "parameters": f.parameters},
             "required": ["name", "parameters"], "additionalProperties": False}
            for name, f in tools.items()]}}
        if not req.parallel_tool_calls:
            calls["maxItems"] = 1
        return ToolCallPlan(StructuredOutputsParams(json=calls), None)
    name = req.tool_choice.function.name
    if name not in tools:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools ({', '.join(tools)})")
    return ToolCallPlan(StructuredOutputsParams(json=tools[name].parameters), name)


def parse_tool_calls(plan: ToolCallPlan, text: str) -> list[dict] | None:
    """OpenAI tool_calls from a finished output, or None if it does not parse (cut short)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    calls = [(plan.function, value)] if plan.function is not None else [(c["name"], c["parameters"]) for c in value]
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args)}} for name, args in calls]
