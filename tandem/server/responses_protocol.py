"""OpenAI's Responses API request (POST /v1/responses), translated to the chat request it means:
instructions, input items (messages, function_call, function_call_output, reasoning), function
tools, text.format, max_output_tokens, after the stored conversation of previous_response_id. A
field not declared is a 400 naming it; the hints say why they cannot change the output."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from tandem.server.limits import MAX_MESSAGES, MAX_TOOLS, Count, Schema
from tandem.server.protocol import REASONING_EFFORT, ChatCompletionRequest
from tandem.server.protocol_parts import Base, doc, hint, tool_call

REFUSED = {
    "background": "responses run while the request is open",
    "conversation": "use previous_response_id",
    "prompt": "no stored prompts here",
    "max_tool_calls": "not implemented",
    "context_management": "not implemented",
}


class InputText(Base):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = hint(None, "an earlier answer's annotations")
    logprobs: list[Any] | None = hint(None, "an earlier answer's logprobs")


class MessageItem(Base):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = hint(None, "an earlier item's id")
    status: str | None = hint(None, "an earlier item's status")

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionCallItem(Base):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = hint(None, "an earlier item's id")
    status: str | None = hint(None, "an earlier item's status")


class FunctionCallOutputItem(Base):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = hint(None, "an earlier item's id")
    status: str | None = hint(None, "an earlier item's status")


class ReasoningText(Base):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(Base):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(Base):
    type: Literal["reasoning"]
    summary: list[SummaryText] = doc([], "The reasoning, where `content` gives none.")
    content: list[ReasoningText] | None = doc(None, "The reasoning (this server's items).")
    id: str | None = hint(None, "an earlier item's id")
    encrypted_content: str | None = hint(None, "reasoning is kept as text here")
    status: str | None = hint(None, "an earlier item's status")

    def text(self) -> str:
        """The reasoning as the next assistant turn's reasoning_content."""
        return "".join(p.text for p in self.content or self.summary)


def _item_type(value: Any) -> str | None:
    """An item's type; a message may leave it out ({"role": ..., "content": ...})."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(Base):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: Schema | None = None
    strict: bool | None = hint(None, "a call's arguments always follow the schema")


class NamedFunction(Base):
    type: Literal["function"]
    name: str


class TextFormat(Base):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: Schema | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = hint(None, "the schema is always enforced")


class TextConfig(Base):
    format: TextFormat | None = doc(None, "text, json_object or json_schema (structured output).")
    verbosity: Literal["low", "medium", "high"] | None = hint(
        None, "these models have no such switch"
    )


class ReasoningConfig(Base):
    effort: Literal[REASONING_EFFORT] | None = doc(None, "As chat's reasoning_effort.")
    summary: str | None = hint(None, "reasoning is given whole, not summarised")
    generate_summary: str | None = hint(None, "reasoning is given whole, not summarised")


class ResponsesRequest(Base):
    model: str | None = doc(None, "A served name.")
    input: str | Annotated[list[Item], Field(max_length=MAX_MESSAGES)] = doc(
        ..., "A text, or items: messages, function_call, function_call_output, reasoning."
    )
    instructions: str | None = doc(None, "The system prompt (not carried to a next response).")
    previous_response_id: str | None = doc(None, "Go on from a stored response (its key's only).")
    max_output_tokens: Count | None = doc(None, "Default: up to the context.")
    temperature: float | None = doc(None, "0: greedy. Default 1.")
    top_p: float | None = doc(None, "Nucleus sampling. Default 1.")
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = doc(
        None, "Function tools (other types refused)."
    )
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = doc(
        None, "As chat's."
    )
    parallel_tool_calls: bool = doc(True, "false: at most one call.")
    text: TextConfig | None = doc(None, "format: structured output.")
    reasoning: ReasoningConfig | None = doc(None, "effort: the template's thinking switch.")
    stream: bool = doc(False, "Server-sent events, the Responses API's typed ones.")
    store: bool = doc(True, "Keep the response for previous_response_id (bounded; false: not).")
    truncation: Literal["disabled"] | None = doc(
        None, "disabled only: a conversation past the context is a 400."
    )
    include: list[Literal["message.output_text.logprobs", "reasoning.encrypted_content"]] | None = (
        hint(None, "logprobs come with top_logprobs; reasoning is not encrypted here")
    )
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = doc(
        None, "Alternatives per output token, with their logprobs."
    )
    metadata: dict[str, str] | None = hint(None, "tags, given back in the response")
    user: str | None = hint(None, "an end-user id for OpenAI's abuse monitoring")
    safety_identifier: str | None = hint(None, "an end-user id for OpenAI's abuse monitoring")
    service_tier: str | None = hint(None, "OpenAI's billing tier")
    prompt_cache_key: str | None = hint(None, "the prefix cache here is keyed by the tokens")
    stream_options: dict[str, bool] | None = hint(
        None, "include_obfuscation: chunks are not padded"
    )

    def messages(self) -> list[dict[str, Any]]:
        """The input as chat messages: consecutive calls one assistant turn, a reasoning item
        the next assistant turn's reasoning_content."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        reasoning = None
        for item in self.input:
            if isinstance(item, ReasoningItem):
                reasoning = item.text()
                continue
            if isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": item.text()})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            else:
                call = tool_call(item.call_id, item.name, item.arguments)
                if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                    out[-1]["tool_calls"].append(call)
                    continue
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            if reasoning is not None and out[-1]["role"] == "assistant":
                out[-1]["reasoning_content"], reasoning = reasoning, None
        return out

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request after `history` (the previous response's conversation)."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": system + history + self.messages(),
            "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
            "logprobs": self.top_logprobs is not None,
            "top_logprobs": self.top_logprobs,
        }
        if self.tools:
            chat["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
        if self.tool_choice is not None:
            chat["tool_choice"] = (
                self.tool_choice
                if isinstance(self.tool_choice, str)
                else {"type": "function", "function": {"name": self.tool_choice.name}}
            )
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type != "text":
            schema = {"name": fmt.name or "output", "schema": fmt.schema_ or {}}
            chat["response_format"] = (
                {"type": fmt.type}
                if fmt.type == "json_object"
                else {"type": "json_schema", "json_schema": schema}
            )
        if self.reasoning and self.reasoning.effort:
            chat["reasoning_effort"] = self.reasoning.effort
        return ChatCompletionRequest.model_validate(chat)
