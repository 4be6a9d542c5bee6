"""Each route module alone: a FastAPI app holding just that router and a fake serving state
(no engine, no model), called through a TestClient. The prompt rules are the engine's: a route
passes the engine's ValueError on as a 400 with the engine's own message."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient
from route_fixture import EMPTY, FakeLLM

from tandem.config import QuantizationConfig
from tandem.engine.precision import PrecisionRouter
from tandem.server.errors import add_error_handlers
from tandem.server.routes import chat, completions, health, models, tokenize
from tandem.server.state import EngineFacts, ServerConfig, ServingState

TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if style is defined %}style: {{ style }}\n{% endif %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
WORDS = ["<unk>", "user", "assistant", "tools", "style", ":", "hi", "there", "terse", "get_weather"]


def word_tokenizer():
    """A real Hugging Face tokenizer, one id per word of WORDS."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    fast.chat_template = TEMPLATE
    return fast


def fake_tokenize(prompt):
    if isinstance(prompt, str):
        return word_tokenizer().encode(prompt)
    bad = [t for t in prompt if not 0 <= t < len(WORDS)]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (engine)")
    return list(prompt)


def client_for(router: APIRouter, llm=None, alive: bool = True) -> tuple[TestClient, ServingState]:
    facts = EngineFacts(
        tokenizer=word_tokenizer(),
        tokenize=fake_tokenize,
        max_model_len=32,
        vocab_size=len(WORDS),
        precisions=PrecisionRouter(QuantizationConfig(), "fp32", {}),
        compile_grammar=None,
    )
    llm = llm or FakeLLM()
    llm.alive = alive
    state = ServingState(llm, ServerConfig(model_name="m"), SimpleNamespace(registry=None), facts)
    app = FastAPI()
    app.include_router(router)
    add_error_handlers(app)
    app.state.serving = state
    return TestClient(app), state


def test_completions_alone_passes_the_prompt_and_the_engines_refusal():
    client, state = client_for(completions.router)
    r = client.post(
        "/v1/completions", json={"model": "m", "prompt": [6, 7], "max_tokens": 3, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "ok" and r.json()["usage"]["prompt_tokens"] == 2
    ids, params = state.llm.requests[-1]
    assert ids == [6, 7] and params.max_tokens == 3 and params.temperature == 0
    empty = client.post("/v1/completions", json={"model": "m", "prompt": ""})
    assert empty.status_code == 400 and empty.json()["error"]["message"] == EMPTY
    outside = client.post("/v1/completions", json={"model": "m", "prompt": [99]})
    assert outside.status_code == 400 and outside.json()["error"]["message"].endswith("(engine)")
    room = client.post("/v1/completions", json={"model": "m", "prompt": [6, 7], "max_tokens": 31})
    assert room.status_code == 400 and room.json()["error"]["param"] == "max_tokens"
    assert client.post("/v1/completions", json={"model": "other", "prompt": [6]}).status_code == 404


def test_completions_alone_streams_sse():
    client, _ = client_for(completions.router)
    r = client.post(
        "/v1/completions",
        json={
            "model": "m",
            "prompt": [6],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["text"] == "ok" and chunks[-1]["usage"]["completion_tokens"] == 1


def test_chat_alone_renders_the_one_chat_prompt():
    client, state = client_for(chat.router)
    messages = [{"role": "user", "content": "hi"}]
    assert client.post("/v1/chat/completions", json={"messages": messages}).status_code == 200
    ids, _ = state.llm.requests[-1]
    assert ids == word_tokenizer().encode("user: hi\nassistant:")
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": messages,
            "chat_template_kwargs": {"style": "terse"},
            "add_generation_prompt": False,
        },
    )
    assert r.status_code == 200 and state.llm.requests[-1][0] == word_tokenizer().encode(
        "user: hi\nstyle: terse\n"
    )
    alone = client.post("/v1/chat/completions", json={"messages": messages, "top_logprobs": 2})
    assert alone.status_code == 400 and alone.json()["error"]["param"] == "top_logprobs"
    many = client.post(
        "/v1/chat/completions", json={"messages": messages, "logprobs": True, "top_logprobs": 30}
    )
    assert (
        many.status_code == 400 and "logprobs must be in [0, 20]" in many.json()["error"]["message"]
    )


def test_tokenize_alone_follows_add_generation_prompt_tools_and_kwargs():
    client, _ = client_for(tokenize.router)
    tok = word_tokenizer()
    messages = [{"role": "user", "content": "hi there"}]

    def count(**body):
        r = client.post("/tokenize", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["max_model_len"] == 32
        return r.json()["tokens"]

    assert count(messages=messages) == tok.encode("user: hi there\nassistant:")
    assert count(messages=messages, add_generation_prompt=False) == tok.encode("user: hi there\n")
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    assert count(messages=messages, tools=tools, add_generation_prompt=False) == tok.encode(
        "tools: get_weather\nuser: hi there\n"
    )
    assert count(prompt="hi there") == [6, 7]
    # a variable the template does not read is accepted, and has no effect
    assert count(messages=messages, chat_template_kwargs={"colour": "red"}) == tok.encode(
        "user: hi there\nassistant:"
    )
    reserved = client.post(
        "/tokenize", json={"messages": messages, "chat_template_kwargs": {"tokenize": True}}
    )
    assert reserved.status_code == 400 and "cannot be set" in reserved.json()["error"]["message"]
    assert client.post("/tokenize", json={}).status_code == 400


def test_detokenize_alone_uses_the_engines_vocabulary_rule():
    client, _ = client_for(tokenize.router)
    assert client.post("/detokenize", json={"tokens": [6, 7]}).json()["prompt"] == "hi there"
    r = client.post("/detokenize", json={"tokens": [6, 99]})
    assert r.status_code == 400 and r.json()["error"]["message"].endswith("(engine)")


@pytest.mark.parametrize("alive,status", [(True, 200), (False, 503)])
def test_health_alone(alive, status):
    client, _ = client_for(health.router, alive=alive)
    assert client.get("/health").status_code == status


def test_models_alone():
    client, _ = client_for(models.router)
    data = client.get("/v1/models").json()["data"]
    assert (
        [d["id"] for d in data] == ["m"]
        and data[0]["max_model_len"] == 32
        and data[0]["precision"] == "fp32"
    )
