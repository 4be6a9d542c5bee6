"""Bounds on the sizes a client controls, so that no request makes the server allocate out of
proportion to them. The body's size is the server's `--max-request-bytes` (413, counted while
the body is read: server/middleware.py), `n` its `max_n`, a prompt plus `max_tokens` the
context (400); the rest are these constants, enforced by the request models (a 400 naming the
field) and listed in the OpenAPI document."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, Field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what crosses to the engine core (msgpack, torch)
MAX_PROMPTS = 64  # prompts in one /v1/completions batch
MAX_STOP = 16  # stop strings
MAX_STOP_CHARS = 512  # characters per stop string
MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 2048  # chat messages
MAX_TOOLS = 128
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_CHOICES = 1024  # strings of a `choice` constraint
MAX_CONSTRAINT_CHARS = (
    1 << 20
)  # a regex, a grammar, a choice, a JSON schema's text (compiling has a timeout)
MAX_SCHEMA_DEPTH = 32  # nesting of a JSON schema (objects and arrays)

LIMITS_HELP = (
    f"Request limits (a 400 naming the field past them): n <= max_n (16), prompt + max_tokens <= "
    f"max_model_len, {MAX_STOP} stop strings of {MAX_STOP_CHARS} characters, {MAX_STOP_TOKEN_IDS} "
    f"stop_token_ids, logprobs / top_logprobs <= 20, {MAX_MESSAGES} messages, {MAX_TOOLS} tools, "
    f"{MAX_LOGIT_BIAS} logit_bias entries, "
    f"{MAX_PROMPTS} prompts per batch, {MAX_CHOICES} choice strings, "
    f"{MAX_CONSTRAINT_CHARS} characters of regex / grammar / JSON schema, "
    f"schema nesting {MAX_SCHEMA_DEPTH}; the body: "
    f"--max-request-bytes (413)."
)

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[
    int, Field(ge=0, le=INT64_MAX)
]  # a non-negative number that crosses to the engine
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]  # the vocabulary's bound is the engine's rule
ConstraintText = Annotated[str, Field(max_length=MAX_CONSTRAINT_CHARS)]


def nesting_depth(value: Any) -> int:
    """Depth of nested objects and arrays, walked without recursion."""
    depth, level = 0, [value]
    while level:
        level = [
            v
            for x in level
            if isinstance(x, (dict, list))
            for v in (x.values() if isinstance(x, dict) else x)
        ]
        depth += 1
    return depth - 1


def check_schema(schema: dict[str, Any] | str) -> dict[str, Any] | str:
    """A JSON schema (or its text) within MAX_CONSTRAINT_CHARS and MAX_SCHEMA_DEPTH."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ValueError(
            f"the JSON schema is {len(text)} characters; at most {MAX_CONSTRAINT_CHARS}"
        )
    try:
        parsed = json.loads(text) if isinstance(schema, str) else schema
    except ValueError:
        return schema  # not JSON: StructuredOutputsParams names that
    if nesting_depth(parsed) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    return schema


def check_stop(stop: str | list[str] | None) -> str | list[str] | None:
    strings = [stop] if isinstance(stop, str) else stop or []
    if len(strings) > MAX_STOP:
        raise ValueError(f"at most {MAX_STOP} stop strings, got {len(strings)}")
    if any(len(s) > MAX_STOP_CHARS for s in strings):
        raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters")
    return stop


def check_prompts(prompt: Any) -> Any:
    """A batch of prompts (a list of texts or of token-id lists) within MAX_PROMPTS."""
    if (
        isinstance(prompt, list)
        and prompt
        and not isinstance(prompt[0], int)
        and len(prompt) > MAX_PROMPTS
    ):
        raise ValueError(f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}")
    return prompt


Stop = Annotated[str | list[str], AfterValidator(check_stop)]
Prompt = Annotated[
    str | list[str] | list[TokenId] | list[list[TokenId]], AfterValidator(check_prompts)
]
Schema = Annotated[dict[str, Any], AfterValidator(check_schema)]
SchemaOrText = Annotated[dict[str, Any] | ConstraintText, AfterValidator(check_schema)]
Choices = Annotated[list[ConstraintText], Field(max_length=MAX_CHOICES)]
LogitBias = Annotated[
    dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=MAX_LOGIT_BIAS)
]
