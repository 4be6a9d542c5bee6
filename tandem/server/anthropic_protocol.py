"""Anthropic's Messages API request (POST /v1/messages, /v1/messages/count_tokens), translated
to the chat request it means: system, text / tool_use / tool_result blocks, tools and
tool_choice, stop_sequences and the sampling fields. As for the OpenAI bodies, a field not
declared is a 400 naming it, and the hints say why they cannot change the output."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from tandem.server.limits import MAX_MESSAGES, MAX_STOP, MAX_TOOLS, Count, Int64, Schema
from tandem.server.protocol import ChatCompletionRequest
from tandem.server.protocol_parts import Base, doc, hint, tool_call

REFUSED = {  # fields Anthropic's clients send that would change the output, not implemented
    "mcp_servers": "no MCP client here",
    "container": "no code execution here",
    "context_management": "not implemented",
}


class TextBlock(Base):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = hint(None, "the prefix cache here needs no marks")
    citations: list[dict[str, Any]] | None = hint(None, "citations from earlier answers")


class ToolUseBlock(Base):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = hint(None, "the prefix cache here needs no marks")


class ToolResultBlock(Base):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = doc(False, "The result is told as an error.")
    cache_control: dict[str, Any] | None = hint(None, "the prefix cache here needs no marks")

    def text(self) -> str:
        text = self.content
        if not isinstance(text, str):
            text = "".join(b.text for b in text)
        return f"Error: {text}" if self.is_error else text


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class AnthropicMessage(Base):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def openai(self) -> list[dict[str, Any]]:
        """The OpenAI messages this turn is: tool results as `tool` messages, then the rest."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        text = "".join(b.text for b in self.content if isinstance(b, TextBlock))
        results = [
            {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
            for b in self.content
            if isinstance(b, ToolResultBlock)
        ]
        calls = [
            tool_call(b.id, b.name, json.dumps(b.input))
            for b in self.content
            if isinstance(b, ToolUseBlock)
        ]
        if calls:
            return [*results, {"role": self.role, "content": text or None, "tool_calls": calls}]
        return [*results, {"role": self.role, "content": text}] if text or not results else results


class AnthropicTool(Base):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: Schema
    type: Literal["custom"] | None = None  # server tools (web search, ...) are other types: refused
    cache_control: dict[str, Any] | None = hint(None, "the prefix cache here needs no marks")


class AnthropicToolChoice(Base):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = doc(False, "At most one call.")

    def openai(self) -> str | dict[str, Any]:
        if self.type == "tool":
            if not self.name:
                raise ValueError("tool_choice: type tool needs a `name`")
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class JsonOutputFormat(Base):
    type: Literal["json_schema"]
    schema_: Schema = Field(alias="schema")


class OutputConfig(Base):
    format: JsonOutputFormat | None = doc(None, "The answer as JSON of this schema.")
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = doc(
        None, "reasoning_effort of a chat request (xhigh and max: high)."
    )

    def openai(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if self.format is not None:
            fields["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": self.format.schema_},
            }
        if self.effort is not None:
            effort = self.effort
            fields["reasoning_effort"] = "high" if effort in ("xhigh", "max") else effort
        return fields


class ThinkingConfig(Base):
    type: Literal["enabled", "disabled", "adaptive"] = doc(
        ..., "enabled: think up to budget_tokens; disabled: the template's thinking switch off."
    )
    budget_tokens: Count | None = doc(
        None, "thinking_token_budget of a chat request: then `</think>` is forced."
    )

    def openai(self) -> dict[str, Any]:
        if self.type == "disabled":
            return {"reasoning_effort": "none"}
        if self.type == "enabled" and self.budget_tokens is not None:
            return {"thinking_token_budget": self.budget_tokens}
        return {}


class CountTokensRequest(Base):
    model: str = doc(..., "A served name.")
    messages: list[AnthropicMessage] = Field(
        min_length=1,
        max_length=MAX_MESSAGES,
        description=("Turns of text, tool_use and tool_result blocks (images refused)."),
    )
    system: str | list[TextBlock] | None = doc(None, "The system prompt.")
    tools: Annotated[list[AnthropicTool], Field(max_length=MAX_TOOLS)] | None = doc(
        None, "Custom tools: name, description, input_schema."
    )
    tool_choice: AnthropicToolChoice | None = doc(None, "auto, any, tool (named) or none.")
    thinking: ThinkingConfig | None = doc(None, "A reasoning model's thinking: on, off, budget.")

    def chat_request(self, **fields: Any) -> ChatCompletionRequest:
        """The chat request this one means; ValueError (pydantic's too) for what cannot be."""
        system = (
            self.system
            if isinstance(self.system, str) or self.system is None
            else "".join(b.text for b in self.system)
        )
        messages = [{"role": "system", "content": system}] if system else []
        messages += [m for message in self.messages for m in message.openai()]
        thinking = self.thinking.openai() if self.thinking else {}
        chat: dict[str, Any] = {"model": self.model, "messages": messages, **thinking, **fields}
        if self.tools:
            chat["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.input_schema,
                    },
                }
                for t in self.tools
            ]
        if self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice.openai()
            chat["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        return ChatCompletionRequest.model_validate(chat)


class MessagesRequest(CountTokensRequest):
    max_tokens: Count = doc(..., "Tokens to generate at most.")
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP)] | None = doc(
        None, "Strings that end the output (stop_reason stop_sequence)."
    )
    stream: bool = doc(False, "Server-sent events, Anthropic's.")
    temperature: float | None = doc(None, "0: greedy. Default 1.")
    top_p: float | None = doc(None, "Nucleus sampling. Default 1.")
    top_k: Int64 | None = doc(None, "0 or -1: off.")
    output_config: OutputConfig | None = doc(None, "format (a JSON schema) and effort.")
    metadata: dict[str, Any] | None = hint(None, "a user id for Anthropic's abuse monitoring")
    service_tier: str | None = hint(None, "Anthropic's capacity tier")
    cache_control: dict[str, Any] | None = hint(None, "the prefix cache here needs no marks")

    def sampling(self) -> dict[str, Any]:
        """The chat request's fields beside the conversation."""
        output = self.output_config.openai() if self.output_config else {}
        return {
            "max_tokens": self.max_tokens,
            "stop": self.stop_sequences,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stream": self.stream,
            **output,
        }
