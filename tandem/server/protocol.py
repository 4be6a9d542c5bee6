"""OpenAI API request bodies (plus vLLM's extras: top_k, min_p, ignore_eos, priority,
structured_outputs / guided_*, ...). A field not declared here is refused with a 400 naming it;
the few accepted without effect are NO_EFFECT_FIELDS (listed in the README)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.config.request_class import CLASS_NAMES, LEVELS, priority_of
from tandem.core.sampling_params import SamplingParams, StructuredOutputsParams
from tandem.engine.chat import apply_chat_template
from tandem.server.limits import (INT64_MAX, MAX_MESSAGES, MAX_STOP_TOKEN_IDS, MAX_TOOLS, Choices, ConstraintText,
                                   Count, Int64, Prompt, Schema, SchemaOrText, Stop, TokenId)

NO_EFFECT_FIELDS = ("user", "metadata")


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # NaN / Infinity in a float: a 400


class StreamOptions(_Base):
    include_usage: bool = False


class JsonSchemaFormat(_Base):
    name: str
    description: str | None = None
    schema_: Schema = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Base):
    """vLLM's `structured_outputs` request field."""
    json_: SchemaOrText | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: ConstraintText | None = None
    choice: Choices | None = None
    grammar: ConstraintText | None = None


class SamplingFields(_Base):
    model: str | None = None
    n: Annotated[int, Field(ge=1, le=INT64_MAX)] = 1  # and at most the server's max_n
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: Stop | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Count = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    speculative: bool = True  # False: served without speculative decoding
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    priority: Literal[CLASS_NAMES + LEVELS] | None = None  # request class: config/request_class.py
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: SchemaOrText | None = None
    guided_regex: ConstraintText | None = None
    guided_choice: Choices | None = None
    guided_grammar: ConstraintText | None = None
    precision: str | None = None  # a served variant (bf16, int8, int4, ...); see /v1/models

    def constraint(self) -> StructuredOutputsParams | None:
        """The one output constraint the request asks for, from whichever field names it;
        ValueError if it gives several or a bad one."""
        found: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise ValueError("response_format: type json_schema needs a `json_schema` object")
            found.append(("response_format", {"json": rf.json_schema.schema_}))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            fields = {"json": so.json_, "json_object": so.json_object or None, "regex": so.regex,
                      "choice": so.choice, "grammar": so.grammar}
            found.append(("structured_outputs", {k: v for k, v in fields.items() if v is not None}))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                found.append((f"guided_{name}", {name: value}))
        if not found:
            return None
        if len(found) > 1:
            raise ValueError(f"give one output constraint, not several: {', '.join(n for n, _ in found)}")
        where, kwargs = found[0]
        try:
            return StructuredOutputsParams(**kwargs)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """Raises ValueError naming the bad field."""
        def opt(value, default):
            return default if value is None else value
        return SamplingParams(
            n=self.n, temperature=opt(self.temperature, 1.0), top_p=opt(self.top_p, 1.0),
            top_k=opt(self.top_k, 0), min_p=opt(self.min_p, 0.0), seed=self.seed,
            stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
            presence_penalty=opt(self.presence_penalty, 0.0), frequency_penalty=opt(self.frequency_penalty, 0.0),
            repetition_penalty=opt(self.repetition_penalty, 1.0), max_tokens=max_tokens,
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, structured_outputs=structured_outputs,
            speculative=self.speculative,
        )

    @property
    def priority_level(self) -> int | None:
        """1/2/3, or None to let the engine classify the request by its length."""
        return priority_of(self.priority) if self.priority is not None else None


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: Count | None = 16
    logprobs: Int64 | None = None  # its range: SamplingParams


class ContentPart(_Base):
    type: str
    text: str | None = None


class ChatMessage(_Base):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call it answers

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (tool fields only where given)."""
        d: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(p.type != "text" for p in self.content):
            raise ValueError("only text content parts are supported")
        return "".join(p.text or "" for p in self.content)


class FunctionDefinition(_Base):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: Schema = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None  # the schema is always enforced


class Tool(_Base):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Base):
    name: str


class NamedToolChoice(_Base):
    type: Literal["function"]
    function: NamedFunction


def _render_chat(tokenizer, messages: list[ChatMessage], tools: list[Tool] | None, add_generation_prompt: bool,
                chat_template_kwargs: dict[str, Any] | None) -> str:
    """A request's conversation through the one chat prompt (engine/chat.py); ValueError."""
    return apply_chat_template(tokenizer, [m.template_dict() for m in messages],
                               [t.model_dump() for t in tools] if tools else None, add_generation_prompt,
                               chat_template_kwargs)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None  # its range: SamplingParams (logprobs)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def chat_prompt(self, tokenizer) -> str:
        """The prompt text, with the tools the request may call (none under tool_choice "none")."""
        tools = self.tools if self.tool_choice != "none" else None
        return _render_chat(tokenizer, self.messages, tools, self.add_generation_prompt, self.chat_template_kwargs)


class TokenizeRequest(_Base):
    """vLLM's /tokenize: a prompt, or messages rendered as a chat request would render them."""
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    add_special_tokens: bool = True

    def chat_prompt(self, tokenizer) -> str:
        return _render_chat(tokenizer, self.messages or [], self.tools, self.add_generation_prompt,
                           self.chat_template_kwargs)


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[TokenId]
