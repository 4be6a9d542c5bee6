"""What the route handlers share, kept on `app.state.serving`: the engine, the server's config,
its metrics, and the engine facts they read. The facts are filled in one place
(`engine_facts`), so where the engine lives (this process or another) is that function's
business, not every handler's."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from tandem.engine.core_messages import CompileGrammar
from tandem.server.response_store import ResponseStore

if TYPE_CHECKING:
    from tandem.core.sampling_params import StructuredOutputsParams
    from tandem.engine.async_llm import AsyncLLM
    from tandem.engine.precision import PrecisionRouter
    from tandem.server.metrics import ServerMetrics


@dataclass(slots=True)
class ServerConfig:
    model_name: str = "smollm2-135m"  # the name clients send as `model`, and responses report
    api_key: str | None = None
    max_waiting: int = 512  # past this many waiting requests, answer 429
    max_n: int = 16
    max_body_bytes: int = 4 << 20
    request_log: str | None = None  # one JSON line per finished request: lengths and timings
    request_log_text: bool = False  # the log holds the prompt and output text too
    allowed_origins: list[str] | None = None  # CORS: browser origins allowed (None: no CORS headers)
    api_key_classes: dict[str, str] | None = None  # further API keys, each mapped to a request class
    role: str | None = None  # a cluster's instance: colocated | prefill | decode; None: standalone
    elastic: bool = False  # may be switched between prefill and decode by the router
    model_aliases: tuple[str, ...] = ()  # further names accepted as `model` (--served-model-name A B ...)
    tool_call_parser: str | None = None  # hermes, llama3_json, mistral, generic; None: by template
    reasoning_parser: str | None = None  # deepseek_r1 or qwen3 (<think>); None: by template
    reasoning_budget: int = -1  # -1: unlimited; 0: thinking off (the template's switch)
    responses_max_count: int = 1000  # /v1/responses kept for previous_response_id, at most
    responses_max_bytes: int = 64 << 20  # and their size at most
    responses_ttl_s: float = 3600.0  # each kept this long

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.model_aliases)


@dataclass(slots=True)
class EngineFacts:
    """Read-only engine facts and the engine's own input rules, as the HTTP side uses them."""

    tokenizer: Any  # a Hugging Face tokenizer, or None (token-id prompts only)
    tokenize: Callable[[str | list[int]], list[int]]  # the engine's prompt rules; ValueError with its message
    max_model_len: int
    vocab_size: int
    precisions: PrecisionRouter  # the variants served; .check(name) raises ValueError
    compile_grammar: Callable[[StructuredOutputsParams], Awaitable[Any]]  # off the engine's step path; ValueError


def engine_facts(llm: AsyncLLM) -> EngineFacts:
    """The one place the server reads the engine's facts from: AsyncLLM's attributes (the engine
    core's ready handshake) and its front end; constraints compile in the engine process."""
    return EngineFacts(tokenizer=llm.tokenizer, tokenize=llm.tokenize, max_model_len=llm.max_model_len,
                       vocab_size=llm.vocab_size, precisions=llm.precisions,
                       compile_grammar=lambda so: llm.call_utility(CompileGrammar(so)))


@dataclass(slots=True)
class ServingState:
    llm: AsyncLLM  # generate / num_waiting / alive
    config: ServerConfig
    metrics: ServerMetrics
    facts: EngineFacts
    responses: ResponseStore = field(init=False)  # the Responses API's, within the config's bounds

    def __post_init__(self) -> None:
        c = self.config
        self.responses = ResponseStore(c.responses_max_count, c.responses_max_bytes,
                                       c.responses_ttl_s)


def serving_state(request: Request) -> ServingState:
    return request.app.state.serving
