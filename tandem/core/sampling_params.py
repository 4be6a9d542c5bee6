"""Per-request sampling options, validated at construction so bad values never reach a step."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "structural_tag")


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """One constraint on the output (vLLM's names): a JSON Schema, any JSON object, a regex,
    a choice among strings, a grammar (EBNF / llama.cpp's GBNF, rule `root`), or an xgrammar
    structural tag (JSON text: free text, then tagged parts, such as tool calls, by a schema).
    Only its shape is checked here; the grammar engine (executor/grammar_compiler.py) compiles
    it and names what is wrong."""

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in KINDS if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice, "
                f"grammar, structural_tag; got {', '.join(given) or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError("the JSON schema must be an object (or its JSON text)")
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        """json | json_object | regex | choice | grammar | structural_tag (the metrics label)."""
        if self.json_object:
            return "json_object"
        return next(n for n in KINDS if getattr(self, n) is not None)

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what compiled grammars are cached by."""
        kind = self.kind
        if kind == "json":
            # Canonical text, in the schema's own key order (which the output follows).
            text = json.dumps(json.loads(self.json) if isinstance(self.json, str) else self.json)
        elif kind == "choice":
            text = json.dumps(list(self.choice or ()))
        else:
            text = "" if kind == "json_object" else getattr(self, kind)
        return kind, text


@dataclass(slots=True, frozen=True)
class ThinkingBudget:
    """At most `tokens` tokens inside a reasoning block, then its `end` forced (vLLM's
    thinking_token_budget). The block opens with the `start` tokens in the output, or, with no
    `start`, it is open from the first output token (a prompt that ends with <think>)."""

    tokens: int
    start: tuple[int, ...]
    end: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "start", tuple(self.start))
        object.__setattr__(self, "end", tuple(self.end))
        if not isinstance(self.tokens, int) or self.tokens < 0 or not self.end:
            raise ValueError("a thinking budget is a count >= 0 and the block's end tokens")


@dataclass(slots=True, frozen=True)
class LoRARequest:
    """The LoRA adapter a request runs with (vLLM's names): its served name, an id no other
    adapter of the engine takes (reloading a name takes a new one) and its PEFT folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass(slots=True)
class SamplingParams:
    """What to sample and when to stop. Field names follow vLLM / the OpenAI API."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives; 0 = only the sampled token's
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    speculative: bool = True  # False: this request opts out of speculative decoding
    thinking_budget: ThinkingBudget | None = None
    lora_request: LoRARequest | None = None  # None: the base model

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if self.logit_bias and not all(
            isinstance(t, int) and t >= 0 and -100.0 <= b <= 100.0
            for t, b in self.logit_bias.items()
        ):
            bad("logit_bias maps token ids (>= 0) to biases in [-100, 100]")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs must be a StructuredOutputsParams")
            if self.min_tokens:
                bad(
                    "min_tokens cannot be combined with structured outputs: the grammar "
                    "decides where the output may end"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def drafts(self) -> bool:
        """Whether speculative decoding drafts for this request: not when it opted out, nor
        under a grammar or a thinking budget (each masks one position per step)."""
        return self.speculative and self.structured_outputs is None and self.thinking_budget is None
