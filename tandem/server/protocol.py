"""OpenAI API request bodies, with vLLM's extras. Every field is honoured, or accepted as a hint
(it cannot change this server's output: `hint`), and its description says which; a field not
declared is refused with a 400 naming it, and why where REFUSED knows. docs/api_fields.md is
the table of them all (server/api_fields.py writes it)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from tandem.config.request_class import CLASS_NAMES, LEVELS, priority_of
from tandem.core.sampling_params import SamplingParams, StructuredOutputsParams
from tandem.engine.chat import apply_chat_template, template_variables
from tandem.server.limits import (
    INT64_MAX,
    MAX_MESSAGES,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOLS,
    Choices,
    ConstraintText,
    Count,
    Int64,
    LogitBias,
    Prompt,
    SchemaOrText,
    Stop,
    TokenId,
)
from tandem.server.protocol_parts import (
    Base,
    ChatMessage,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputsField,
    Tool,
    doc,
    hint,
    output_constraint,
    response_format_constraint,
)
from tandem.server.tool_parsers import tool_parser
from tandem.server.tool_parsers.base import ToolParser

REFUSED = {  # fields clients send that would change the output and are not implemented
    "suffix": "fill-in-the-middle needs a model trained for it and its own prompt format",
    "use_beam_search": "beam search is not implemented",
    "length_penalty": "beam search is not implemented",
    "allowed_token_ids": "use logit_bias",
    "bad_words": "not implemented",
    "logits_processors": "no custom code runs in the server",
    "guided_whitespace_pattern": "JSON is laid out as json.dumps does",
    "cache_salt": "the prefix cache is shared within a model's precision variant",
    "kv_transfer_params": "P/D goes through `tandem cluster`",
    "chat_template": "use --chat-template",
    "functions": "deprecated by OpenAI: use tools",
    "function_call": "deprecated by OpenAI: use tool_choice",
    "audio": "text only",
    "mm_processor_kwargs": "text only",
    "prediction": "not implemented",
    "documents": "not implemented",
    "web_search_options": "no web search here",
    "echo": "on /v1/completions only",
}  # (where an endpoint does not declare them)
REASONING_EFFORT = ("none", "minimal", "low", "medium", "high")
SpecialTokens = Annotated[
    bool, doc(..., "Whether the tokenizer adds its special tokens (BOS, ...) to the prompt text.")
]


class StreamOptions(Base):
    include_usage: bool = doc(False, "A last chunk with the usage of the whole request.")
    continuous_usage_stats: bool = doc(False, "vLLM's: every chunk carries the usage so far.")
    include_obfuscation: bool = hint(
        True, "OpenAI pads chunks against length side channels; chunks here are not padded"
    )


class SamplingFields(Base):
    model: str | None = doc(None, "A served name (/v1/models), optionally `name:precision`.")
    n: Annotated[int, Field(ge=1, le=INT64_MAX)] = doc(1, "Choices, at most the server's max_n.")
    temperature: float | None = doc(None, "0: greedy. Default 1.")
    top_p: float | None = doc(None, "Nucleus sampling. Default 1.")
    top_k: Int64 | None = doc(None, "vLLM's; 0 or -1: off.")
    min_p: float | None = doc(None, "vLLM's.")
    seed: Int64 | None = doc(None, "The same tokens for the same request, whatever the batch.")
    stop: Stop | None = doc(None, "Strings that end the output (not part of it).")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = doc(
        None, "vLLM's."
    )
    presence_penalty: float | None = doc(None, "In [-2, 2], on tokens in the output.")
    frequency_penalty: float | None = doc(None, "In [-2, 2], per occurrence in the output.")
    repetition_penalty: float | None = doc(None, "vLLM's.")
    logit_bias: LogitBias | None = doc(
        None, "Token id (as a string) -> bias in [-100, 100] added to its logit."
    )
    min_tokens: Count = doc(0, "vLLM's: EOS and stop_token_ids blocked until this many tokens.")
    ignore_eos: bool = doc(False, "vLLM's.")
    skip_special_tokens: bool = doc(True, "vLLM's: special tokens left out of the text.")
    spaces_between_special_tokens: bool = hint(
        True,
        "vLLM's; fast tokenizers (every one served here) decode special tokens as they are, "
        "as in vLLM",
    )
    include_stop_str_in_output: bool = doc(False, "vLLM's.")
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = doc(
        None,
        "vLLM's: each prompt token's logprob and this many alternatives (`prompt_logprobs` "
        "beside the choices).",
    )
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = doc(
        None, "vLLM's: keep the prompt's last k tokens (-1: the context's length)."
    )
    return_tokens_as_token_ids: bool = doc(False, "vLLM's: logprobs name tokens `token_id:N`.")
    speculative: bool = doc(True, "Tandem's: false serves it without speculative decoding.")
    stream: bool = doc(False, "Server-sent events.")
    stream_options: StreamOptions | None = doc(None, "With `stream`.")
    priority: Literal[CLASS_NAMES + LEVELS] | None = doc(
        None, "Tandem's request class (interactive / standard / background or 1-3)."
    )
    precision: str | None = doc(None, "Tandem's: a served variant (bf16, int8, int4, ...).")
    response_format: ResponseFormat | None = doc(None, "text, json_object or json_schema.")
    structured_outputs: StructuredOutputsField | None = doc(
        None, "vLLM's: json, json_object, regex, choice or grammar."
    )
    guided_json: SchemaOrText | None = doc(None, "vLLM's older name (structured_outputs).")
    guided_regex: ConstraintText | None = doc(None, "vLLM's older name.")
    guided_choice: Choices | None = doc(None, "vLLM's older name.")
    guided_grammar: ConstraintText | None = doc(None, "vLLM's older name.")
    guided_decoding_backend: str | None = hint(None, "vLLM's; xgrammar is the one backend here")
    user: str | None = hint(None, "an end-user id for OpenAI's abuse monitoring")
    metadata: dict[str, str] | None = hint(None, "tags for OpenAI's dashboards")
    store: bool | None = hint(None, "OpenAI keeps completions for its dashboards; none kept here")
    service_tier: str | None = hint(None, "OpenAI's billing tier; `priority` is this server's")
    safety_identifier: str | None = hint(None, "an end-user id for OpenAI's abuse monitoring")
    prompt_cache_key: str | None = hint(
        None, "OpenAI's cache routing; the prefix cache here is keyed by the tokens themselves"
    )

    def constraint(self) -> StructuredOutputsParams | None:
        """The one output constraint the request asks for, from whichever field names it;
        ValueError if it gives several or a bad one."""
        found = response_format_constraint(self.response_format)
        if self.structured_outputs is not None:
            so = self.structured_outputs
            fields = {
                "json": so.json_,
                "json_object": so.json_object or None,
                "regex": so.regex,
                "choice": so.choice,
                "grammar": so.grammar,
            }
            found.append(("structured_outputs", {k: v for k, v in fields.items() if v is not None}))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                found.append((f"guided_{name}", {name: value}))
        return output_constraint(found)

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """Raises ValueError naming the bad field."""

        def opt(value, default):
            return default if value is None else value

        bias = None
        if self.logit_bias:
            try:
                bias = {int(t): b for t, b in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias: keys are token ids (integers as strings)") from None
        return SamplingParams(
            n=self.n,
            temperature=opt(self.temperature, 1.0),
            top_p=opt(self.top_p, 1.0),
            top_k=opt(self.top_k, 0),
            min_p=opt(self.min_p, 0.0),
            seed=self.seed,
            stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            presence_penalty=opt(self.presence_penalty, 0.0),
            frequency_penalty=opt(self.frequency_penalty, 0.0),
            repetition_penalty=opt(self.repetition_penalty, 1.0),
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            logit_bias=bias,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=structured_outputs,
            speculative=self.speculative,
        )

    @property
    def priority_level(self) -> int | None:
        """1/2/3, or None to let the engine classify the request by its length."""
        return priority_of(self.priority) if self.priority is not None else None


class CompletionRequest(SamplingFields):
    prompt: Prompt = doc(..., "A text, token ids, or a batch of either.")
    max_tokens: Count | None = doc(16, "0 only with echo: the prompt's logprobs alone.")
    logprobs: Int64 | None = doc(None, "The sampled tokens' logprobs and this many alternatives.")
    echo: bool = doc(False, "The prompt before the output (with its logprobs when `logprobs`).")
    best_of: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = doc(
        None, "Runs this many, answers the n of highest cumulative logprob; not streamed."
    )
    add_special_tokens: SpecialTokens = True


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(
        min_length=1,
        max_length=MAX_MESSAGES,
        description=(
            "Text content (parts of type text), tool calls and tool results, through the model's "
            "chat template."
        ),
    )
    max_tokens: Count | None = doc(None, "Older name of max_completion_tokens.")
    max_completion_tokens: Count | None = doc(None, "Default: up to the context.")
    logprobs: bool = doc(False, "The sampled tokens' logprobs.")
    top_logprobs: Int64 | None = doc(None, "Alternatives per token, with `logprobs: true`.")
    add_generation_prompt: bool = doc(True, "vLLM's: the template's assistant header at the end.")
    continue_final_message: bool = doc(
        False,
        "vLLM's: the output continues the last (assistant) message; needs "
        "add_generation_prompt false.",
    )
    add_special_tokens: SpecialTokens = True
    chat_template_kwargs: dict[str, Any] | None = doc(
        None, "vLLM's: variables for the chat template."
    )
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = doc(
        None, "Functions the model may call (their JSON schemas)."
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = doc(
        None, "none, auto (the default with tools), required, or a named function."
    )
    parallel_tool_calls: bool = doc(True, "false: at most one call.")
    reasoning_effort: Literal[REASONING_EFFORT] | None = doc(
        None,
        "Given to a template that reads it, or as its thinking switch (`enable_thinking`, "
        "`thinking`: off for none); no effect for a template with neither.",
    )
    thinking_token_budget: Count | None = doc(
        None,
        "vLLM's: tokens a reasoning model may think before `</think>` is forced (default: "
        "--reasoning-budget); no effect on a model that does not reason.",
    )
    modalities: list[Literal["text"]] | None = hint(None, "text is the one output modality here")
    verbosity: Literal["low", "medium", "high"] | None = hint(
        None, "OpenAI's models' answer length; these models have no such switch"
    )

    def chat_prompt(self, tokenizer, family: ToolParser | None = None) -> str:
        """The prompt text, with the tools the request may call (none under tool_choice "none"),
        as the served tool-call format shows them (`family`; default: the template's own)."""
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt false")
        tools = self.tools if self.tool_choice != "none" else None
        kwargs = template_kwargs(tokenizer, self.chat_template_kwargs, self.reasoning_effort)
        return render_chat(
            tokenizer,
            family,
            self.messages,
            tools,
            self.forced_tool(),
            self.add_generation_prompt,
            kwargs,
            self.continue_final_message,
        )

    def forced_tool(self) -> str | None:
        """None (tool_choice auto: the output may answer), "required", or the function named."""
        if self.tool_choice in (None, "auto", "none", "required"):
            return self.tool_choice if self.tool_choice == "required" else None
        return self.tool_choice.function.name


def template_kwargs(
    tokenizer, kwargs: dict[str, Any] | None, effort: str | None
) -> dict[str, Any] | None:
    """chat_template_kwargs, with reasoning_effort as the template's own variable or thinking
    switch where it reads one (an explicit kwarg wins)."""
    if effort is None:
        return kwargs
    reads = template_variables(tokenizer)
    kwargs = dict(kwargs or {})
    if "reasoning_effort" in reads:
        kwargs.setdefault("reasoning_effort", effort)
    for switch in ("enable_thinking", "thinking"):
        if switch in reads:
            kwargs.setdefault(switch, effort != "none")
    return kwargs


def render_chat(
    tokenizer,
    family: ToolParser | None,
    messages: list[ChatMessage],
    tools: list[Tool] | None,
    forced: str | None,
    add_generation_prompt: bool,
    chat_template_kwargs: dict[str, Any] | None,
    continue_final_message: bool = False,
) -> str:
    """A request's conversation through the one chat prompt (engine/chat.py), its tools and
    tool turns as the tool-call format shows them; ValueError."""
    family = family or tool_parser(None, tokenizer)
    shown, tools = family.prompt(
        [m.template_dict() for m in messages],
        [t.template_dict() for t in tools] if tools else None,
        forced,
    )
    return apply_chat_template(
        tokenizer, shown, tools, add_generation_prompt, chat_template_kwargs, continue_final_message
    )


class TokenizeRequest(Base):
    """vLLM's /tokenize: a prompt, or messages rendered as a chat request would render them."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    add_special_tokens: bool = True

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request whose prompt this counts (its parts are validated already)."""
        return ChatCompletionRequest.model_construct(
            messages=self.messages or [],
            tools=self.tools,
            add_generation_prompt=self.add_generation_prompt,
            chat_template_kwargs=self.chat_template_kwargs,
        )


class DetokenizeRequest(Base):
    model: str | None = None
    tokens: list[TokenId]
