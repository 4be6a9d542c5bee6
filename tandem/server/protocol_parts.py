"""The parts the request bodies share (protocol.py, and the Responses and Messages APIs
translated to them): the strict base model, hints, chat messages, tools and output constraints."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tandem.core.sampling_params import StructuredOutputsParams
from tandem.server.limits import Choices, ConstraintText, Schema, SchemaOrText

HINT = "hint"  # json_schema_extra marker of a field accepted without effect (docs/api_fields.md)


class Base(BaseModel):
    # A field not declared is a 400 naming it; NaN / Infinity in a float: a 400.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def doc(default: Any, what: str) -> Any:
    """A field honoured as `what` says."""
    return Field(default, description=what)


def hint(default: Any, why: str) -> Any:
    """A field accepted that cannot change the output of this server: why, in the docs table."""
    return Field(default, description=why, json_schema_extra={"x-tandem": HINT})


class JsonSchemaFormat(Base):
    name: str = Field(description="The schema's name.")
    description: str | None = Field(None, description="What the schema is for.")
    schema_: Schema = Field(default_factory=dict, alias="schema", description="The JSON schema.")
    strict: bool | None = hint(None, "the schema is always enforced")


class ResponseFormat(Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(Base):
    """vLLM's `structured_outputs` request field."""

    json_: SchemaOrText | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: ConstraintText | None = None
    choice: Choices | None = None
    grammar: ConstraintText | None = None


def output_constraint(found: list[tuple[str, dict]]) -> StructuredOutputsParams | None:
    """The one constraint of (field, StructuredOutputsParams kwargs) pairs a request gave;
    ValueError if it gives several or a bad one."""
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise ValueError(f"give one output constraint, not several: {names}")
    where, kwargs = found[0]
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def response_format_constraint(rf: ResponseFormat | None) -> list[tuple[str, dict]]:
    if rf is not None and rf.type == "json_object":
        return [("response_format", {"json_object": True})]
    if rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise ValueError("response_format: type json_schema needs a `json_schema` object")
        return [("response_format", {"json": rf.json_schema.schema_})]
    return []


class ContentPart(Base):
    type: str
    text: str | None = None


class ChatMessage(Base):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call it answers
    reasoning_content: str | None = None  # an assistant turn's reasoning (templates may show it)

    @field_validator("tool_calls")
    @classmethod
    def _calls_name_a_function(cls, calls: list[dict[str, Any]] | None) -> Any:
        """Each earlier call names its function, as OpenAI's `{"function": {"name": ...}}`:
        the templates and the parsers read it."""
        for call in calls or ():
            function = call.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError('each tool call needs "function": {"name": ..., "arguments": ...}')
        return calls

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (tool fields only where given; a call's
        arguments as an object, as templates show them, where its JSON text parses)."""
        d: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.tool_calls is not None:
            d["tool_calls"] = [_arguments_parsed(c) for c in self.tool_calls]
        return d

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(p.type != "text" for p in self.content):
            raise ValueError("only text content parts are supported")
        return "".join(p.text or "" for p in self.content)


def _arguments_parsed(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


class FunctionDefinition(Base):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: Schema = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = hint(None, "a call's arguments always follow the schema")


class Tool(Base):
    type: Literal["function"]
    function: FunctionDefinition

    def template_dict(self) -> dict[str, Any]:
        """The tool as chat templates and tool-call formats read it: what it declares, less the
        hint `strict` (a hint must not change the prompt)."""
        return self.model_dump(exclude={"function": {"strict"}}, exclude_none=True)


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """An OpenAI tool call, as an assistant turn carries it (`arguments`: JSON text)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class NamedFunction(Base):
    name: str


class NamedToolChoice(Base):
    type: Literal["function"]
    function: NamedFunction
