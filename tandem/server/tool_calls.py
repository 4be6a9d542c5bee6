"""Tool calls: how a chat request's output becomes OpenAI `tool_calls`. The served model's
family parser (tool_parsers/) reads them from the output, and a constraint keeps each call's
arguments to its tool's schema: with `tool_choice` "auto" (the default with tools) the output
may answer or call, with "required" it calls at least one tool, with a named function that
one. `tool_choice: "none"` ignores `tools`."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from tandem.core.sampling_params import StructuredOutputsParams
from tandem.server.protocol import ChatCompletionRequest
from tandem.server.protocol_parts import tool_call
from tandem.server.reasoning_parser import ThinkParser
from tandem.server.tool_parsers.base import Extracted, ToolCall, ToolParser
from tandem.server.tool_parsers.generic import GenericToolParser


@dataclass(slots=True)
class ToolCallPlan:
    parser: ToolParser  # reads the calls from the output
    constraint: StructuredOutputsParams | None  # None: the calls are parsed, not constrained


def plan_tool_calls(req: ChatCompletionRequest, family: ToolParser) -> ToolCallPlan | None:
    """None when the request calls no tools; ValueError (a 400) for a choice that cannot be."""
    if req.tool_choice == "none":
        return None
    if not req.tools:
        if req.tool_choice is not None:  # OpenAI refuses it too: there is nothing to call
            raise ValueError("tool_choice needs `tools`: this request gives none")
        return None
    tools = [t.template_dict() for t in req.tools]
    choice = req.forced_tool()
    names = [t.function.name for t in req.tools]
    if choice not in (None, "required", *names):
        raise ValueError(
            f"tool_choice names function {choice!r}, which is not in tools ({', '.join(names)})"
        )
    constraint = family.constraint(tools, choice, req.parallel_tool_calls)
    if constraint is None and choice is not None:  # forced where the family cannot be: as JSON
        family = GenericToolParser()
        constraint = family.constraint(tools, choice, req.parallel_tool_calls)
    return ToolCallPlan(family, constraint)


def read_output(
    text: str, plan: ToolCallPlan | None, final: bool, think: ThinkParser | None = None
) -> Extracted:
    """The output's reasoning, its answer's text and the calls in it (as far as a stream may
    tell, unless final)."""
    reasoning, text = think.split(text, final) if think is not None else ("", text)
    got = plan.parser.extract(text, final) if plan is not None else Extracted(text)
    got.reasoning = reasoning
    return got


@dataclass(slots=True)
class Progress:
    """How much of one output's reasoning, text and calls a stream has sent: the chat, Messages
    and Responses streams each send what `news` gives."""

    reasoning: int = 0
    content: int = 0
    calls: int = 0

    def news(self, got: Extracted) -> Extracted:
        """What `got` (the output as read so far) adds to what was sent; sent from now on."""
        new = Extracted(
            got.content[self.content :], got.calls[self.calls :], got.reasoning[self.reasoning :]
        )
        self.reasoning, self.content = len(got.reasoning), len(got.content)
        self.calls = len(got.calls)
        return new


def openai_call(call: ToolCall) -> dict:
    name, arguments = call
    return tool_call(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments))
