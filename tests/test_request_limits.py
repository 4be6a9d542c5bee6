"""Every size a client controls has a bound, answered with an OpenAI-style 4xx naming it: the
body (413, counted while it is read, chunked bodies too), the prompt and max_tokens against
the context, n, stop strings, logprobs, messages, tools, prompts per batch, constraint text and
schema nesting, integers that cross to the engine core."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI, Request
from server_fixture import running_server, serving
from test_server_routes import client_for

from tandem.config import EngineConfig
from tandem.server import limits as L
from tandem.server.middleware import BodySizeLimit
from tandem.server.routes import chat, completions, tokenize
from tandem.server.state import ServerConfig

HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f"}}


def nested(depth: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


COMPLETION_LIMITS = [
    ("stop", {"stop": ["x"] * (L.MAX_STOP + 1)}, "at most 16 stop strings"),
    ("stop", {"stop": "x" * (L.MAX_STOP_CHARS + 1)}, "at most 512 characters"),
    ("stop_token_ids", {"stop_token_ids": [1] * (L.MAX_STOP_TOKEN_IDS + 1)}, "at most 64 items"),
    ("logprobs", {"logprobs": 21}, "logprobs must be in [0, 20]"),
    ("prompt", {"prompt": ["hi"] * (L.MAX_PROMPTS + 1)}, "at most 64 prompts"),
    (
        "guided_regex",
        {"guided_regex": "a" * (L.MAX_CONSTRAINT_CHARS + 1)},
        f"at most {L.MAX_CONSTRAINT_CHARS} char",
    ),
    (
        "guided_grammar",
        {"guided_grammar": "a" * (L.MAX_CONSTRAINT_CHARS + 1)},
        f"at most {L.MAX_CONSTRAINT_CHARS} char",
    ),
    ("guided_choice", {"guided_choice": ["a"] * (L.MAX_CHOICES + 1)}, "at most 1024 items"),
    ("guided_json", {"guided_json": nested(L.MAX_SCHEMA_DEPTH)}, "nests deeper than 32"),
    (
        "guided_json",
        {"guided_json": {"enum": ["x" * L.MAX_CONSTRAINT_CHARS]}},
        f"at most {L.MAX_CONSTRAINT_CHARS}",
    ),
    (
        "structured_outputs.json",
        {"structured_outputs": {"json": nested(L.MAX_SCHEMA_DEPTH)}},
        "nests deeper",
    ),
    ("seed", {"seed": L.INT64_MAX + 1}, "less than or equal to 9223372036854775807"),
    ("top_k", {"top_k": -(2**70)}, "greater than or equal"),
    ("min_tokens", {"min_tokens": -1}, "greater than or equal to 0"),
    ("max_tokens", {"max_tokens": 10**30}, "less than or equal"),
    ("n", {"n": 17}, "n must be at most 16"),
]


@pytest.mark.parametrize("param,extra,message", COMPLETION_LIMITS)
def test_completion_limit(param, extra, message):
    client, state = client_for(completions.router)
    r = client.post("/v1/completions", json={"prompt": "hi", **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (
        message in err["message"]
        and err["param"] in (param, None)
        and err["type"] == "invalid_request_error"
    )
    assert not state.llm.requests  # refused before the engine saw anything
    assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 200


CHAT_LIMITS = [
    ("messages", {"messages": HI * (L.MAX_MESSAGES + 1)}, "at most 2048 items"),
    (
        "tools",
        {"tools": [TOOL] * (L.MAX_TOOLS + 1), "tool_choice": "required"},
        "at most 128 items",
    ),
    (
        "tools.0.function.parameters",
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": nested(L.MAX_SCHEMA_DEPTH)},
                }
            ],
            "tool_choice": "required",
        },
        "nests deeper",
    ),
    (
        "response_format.json_schema.schema",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": nested(L.MAX_SCHEMA_DEPTH)},
            }
        },
        "nests deeper",
    ),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 21}, "logprobs must be in [0, 20]"),
    (
        "messages.1.tool_calls",
        {"messages": [*HI, {"role": "assistant", "tool_calls": [{"id": "c1"}]}]},
        "each tool call needs",
    ),
]


@pytest.mark.parametrize("param,extra,message", CHAT_LIMITS)
def test_chat_limit(param, extra, message):
    client, state = client_for(chat.router)
    r = client.post("/v1/chat/completions", json={"messages": HI, **extra})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    assert r.json()["error"]["param"] in (param, None)
    assert not state.llm.requests


def test_tokenize_limits():
    client, _ = client_for(tokenize.router)
    assert client.post("/tokenize", json={"messages": HI * (L.MAX_MESSAGES + 1)}).status_code == 400
    assert client.post("/detokenize", json={"tokens": [2**40]}).status_code == 400


def test_a_schema_at_the_limits_is_accepted():
    """The bounds are where they say: depth 32 and 64 Ki characters pass the request model."""
    from tandem.server.protocol import CompletionRequest

    req = CompletionRequest(
        prompt="x", guided_json=nested(L.MAX_SCHEMA_DEPTH // 2 - 1), stop=["s"] * L.MAX_STOP
    )
    assert L.nesting_depth(req.guided_json) <= L.MAX_SCHEMA_DEPTH


def echo_app(max_bytes: int) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    app.add_middleware(BodySizeLimit, max_bytes=max_bytes)
    return app


def test_body_limit_counts_a_chunked_body_while_it_is_read():
    """No content-length: the body is refused once past the limit, not buffered whole first."""
    sent = 0

    def chunks():
        nonlocal sent
        for _ in range(4096):  # 4 GiB if it were all read
            sent += 1
            yield b"x" * (1 << 20)

    with serving(echo_app(1 << 20)) as (url, _):
        assert httpx.post(url + "/echo", content=b"x" * 1000).json() == {"bytes": 1000}
        try:
            r = httpx.post(url + "/echo", content=chunks(), timeout=30)
            assert (
                r.status_code == 413 and "larger than 1048576 bytes" in r.json()["error"]["message"]
            )
        except httpx.HTTPError:  # the server answered and closed while the client still wrote
            pass
        assert sent < 64
        r = httpx.post(url + "/echo", content=b"x" * (2 << 20), timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
        assert httpx.post(url + "/echo", content=b"ok").json() == {"bytes": 2}


def test_context_limits_on_a_real_engine(tiny_model_dirs):
    """The prompt at the context and max_tokens past the room it leaves: 400s from the engine and
    the server; a request within both is served."""
    engine = EngineConfig.from_kwargs(
        model=tiny_model_dirs["llama"], dtype="float32", kv_cache_memory=1 << 20, max_model_len=64
    )
    with running_server(engine, ServerConfig(model_name="tiny", max_n=2)) as (url, _):

        def post(**body):
            return httpx.post(
                url + "/v1/completions", json={"prompt": [1] * 10, **body}, timeout=60
            )

        r = post(prompt=[1] * 64)
        assert r.status_code == 400 and "the prompt has 64 tokens" in r.json()["error"]["message"]
        r = post(max_tokens=55)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = post(n=3)
        assert r.status_code == 400 and "n must be at most 2" in r.json()["error"]["message"]
        r = post(seed=L.INT64_MIN, max_tokens=54, ignore_eos=True, temperature=1.0, n=2)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 108
