"""What the route handlers share, kept on `app.state.serving`: the engine, the server's config,
its metrics, and the engine facts they read. The facts are filled in one place
(`engine_facts`), so where the engine lives (this process or another) is that function's
business, not every handler's."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from tandem.config import InstanceRole, LoRAConfig
from tandem.config.option import option
from tandem.engine.core_messages import CompileGrammar
from tandem.engine.lora_names import LoRANames
from tandem.server.reasoning_parser import REASONING_PARSERS
from tandem.server.response_store import ResponseStore
from tandem.server.tool_parsers import TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from tandem.core.sampling_params import StructuredOutputsParams
    from tandem.engine.async_llm import AsyncLLM
    from tandem.engine.precision import PrecisionRouter
    from tandem.server.metrics import ServerMetrics


@dataclass(slots=True)
class ServerConfig:
    """The server's options; `tandem serve` derives its flags from the fields declared with
    option() (config/args.py), YAML serving.server takes them by name."""

    # The names served, from --served-model-name A B ... or serving.server.served_model_name
    # (launch.py): the first is the one responses report. Not options of their own.
    model_name: str
    model_aliases: tuple[str, ...] = ()
    api_key: str | None = option(
        None, "bearer token clients must send", none="$TANDEM_API_KEY, else none"
    )
    max_waiting: int = option(512, "waiting requests before answering 429", unit="requests")
    max_n: int = option(16, "completions one request may ask for at most (`n`)", flag=False)
    max_body_bytes: int = option(
        4 << 20,
        "largest request body, counted while it is read: 413 past it",
        unit="bytes",
        flag="--max-request-bytes",
    )
    request_log: str | None = option(
        None, "append one JSON line per finished request to this file", none="no log"
    )
    request_log_text: bool = option(
        False, "the request log holds each prompt and output text too, not only lengths and timings"
    )
    allowed_origins: list[str] | None = option(
        None,
        "comma-separated browser origins allowed cross-origin (CORS)",
        none="none, no CORS headers",
    )
    api_key_classes: dict[str, str] | None = option(
        None, "further API keys, each mapped to a request class", none="none", flag=False
    )
    role: InstanceRole | None = option(
        None,
        "role in a cluster's model group (tandem cluster)",
        none="none, a standalone server whose P/D routes answer 409",
    )
    elastic: bool = option(False, "the router may switch this instance's role")
    tool_call_parser: str | None = option(
        None,
        "the model's tool-call format",
        choices=TOOL_CALL_PARSERS,
        none="from its chat template; generic if it has none",
    )
    reasoning_parser: str | None = option(
        None,
        "reasoning as reasoning_content: <think>...</think>",
        choices=REASONING_PARSERS,
        none="a chat template that writes <think>",
    )
    reasoning_budget: int = option(
        -1,
        "tokens a reasoning model may think before </think> is forced (a request's "
        "thinking_token_budget wins); -1: unlimited; 0: thinking off, by the chat template's "
        "switch too",
        unit="tokens",
    )
    responses_max_count: int = option(
        1000, "/v1/responses kept for previous_response_id, at most", unit="responses"
    )
    responses_max_bytes: int = option(64 << 20, "the kept responses' size, at most", unit="bytes")
    responses_ttl_s: float = option(3600.0, "how long a response is kept", unit="seconds")

    def __post_init__(self) -> None:
        if self.reasoning_budget < -1:
            raise ValueError(f"reasoning_budget must be >= -1, got {self.reasoning_budget}")
        if self.role is not None:
            self.role = InstanceRole.parse(self.role, "role")

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.model_aliases)


@dataclass(slots=True)
class EngineFacts:
    """Read-only engine facts and the engine's own input rules, as the HTTP side uses them."""

    tokenizer: Any  # a Hugging Face tokenizer, or None (token-id prompts only)
    tokenize: Callable[
        [str | list[int]], list[int]
    ]  # the engine's prompt rules; ValueError with its message
    max_model_len: int
    vocab_size: int
    precisions: PrecisionRouter  # the variants served; .check(name) raises ValueError
    compile_grammar: Callable[
        [StructuredOutputsParams], Awaitable[Any]
    ]  # off the engine's step path; ValueError


def engine_facts(llm: AsyncLLM) -> EngineFacts:
    """The one place the server reads the engine's facts from: AsyncLLM's attributes (the engine
    core's ready handshake) and its front end; constraints compile in the engine process."""
    return EngineFacts(
        tokenizer=llm.tokenizer,
        tokenize=llm.tokenize,
        max_model_len=llm.max_model_len,
        vocab_size=llm.vocab_size,
        precisions=llm.precisions,
        compile_grammar=lambda so: llm.call_utility(CompileGrammar(so)),
    )


@dataclass(slots=True)
class ServingState:
    llm: AsyncLLM  # generate / num_waiting / alive
    config: ServerConfig
    metrics: ServerMetrics
    facts: EngineFacts
    responses: ResponseStore = field(init=False)  # the Responses API's, within the config's bounds
    loras: LoRANames = field(default_factory=lambda: LoRANames(LoRAConfig()))  # served by name

    def __post_init__(self) -> None:
        c = self.config
        self.responses = ResponseStore(
            c.responses_max_count, c.responses_max_bytes, c.responses_ttl_s
        )


def serving_state(request: Request) -> ServingState:
    return request.app.state.serving
