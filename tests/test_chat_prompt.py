"""One chat prompt (engine/chat.py): for the same messages and tools, the server's chat route,
its /tokenize, the router's prefix tokenisation and `LLM.chat` produce the same token ids, so
prefix-aware routing hashes what the instance caches and /tokenize counts what a chat sends."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from route_fixture import FakeLLM
from structured_fixture import with_tokenizer

from tandem import LLM, SamplingParams
from tandem.cluster.router.prefix import PromptTokenizer
from tandem.server.errors import add_error_handlers
from tandem.server.routes import chat, tokenize
from tandem.server.state import EngineFacts, ServerConfig, ServingState

TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% if m.tool_calls %} calls {{ m.tool_calls | length }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    {"role": "user", "content": "and Rome?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs, tmp_path_factory):
    from transformers import AutoTokenizer

    path = with_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("chat") / "tiny-chat")
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, dtype="float32", kv_cache_memory=1 << 22)


def server_client(llm: LLM) -> tuple[TestClient, FakeLLM]:
    """The chat and tokenize routes over the real engine's tokenizer and prompt rules; the engine
    stream is faked (it records the prompt ids it is given)."""
    engine = llm.engine

    async def compiled(_):
        return None

    facts = EngineFacts(
        tokenizer=engine.tokenizer,
        tokenize=engine.tokenize,
        max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size,
        precisions=engine.precisions,
        compile_grammar=compiled,
    )
    counter = SimpleNamespace(labels=lambda *_: SimpleNamespace(inc=lambda: None))
    fake = FakeLLM()
    app = FastAPI()
    for router in (chat.router, tokenize.router):
        app.include_router(router)
    add_error_handlers(app)
    app.state.serving = ServingState(
        fake, ServerConfig(model_name="tiny"), SimpleNamespace(structured_requests=counter), facts
    )
    return TestClient(app), fake


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_server_router_and_llm_chat_tokenise_a_chat_alike(llm, model_dir, add_generation_prompt):
    client, fake = server_client(llm)
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "add_generation_prompt": add_generation_prompt,
        "max_tokens": 2,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    served = fake.requests[-1][0]
    text = llm.tokenizer.decode(served)
    assert (
        text.startswith("tools: get_weather\n") and "assistant:  calls 1\n" in text
    )  # tools and tool turns rendered
    assert text.endswith("assistant: ") == add_generation_prompt

    routed = PromptTokenizer(model_dir).token_ids("/v1/chat/completions", body)
    offline = llm.chat(
        MESSAGES,
        SamplingParams(max_tokens=1),
        tools=TOOLS,
        add_generation_prompt=add_generation_prompt,
    )[0].prompt_token_ids
    counted = client.post(
        "/tokenize",
        json={"messages": MESSAGES, "tools": TOOLS, "add_generation_prompt": add_generation_prompt},
    ).json()["tokens"]
    assert served == routed == offline == counted


def test_tool_choice_none_renders_no_tools_for_the_server_and_the_router(llm, model_dir):
    client, fake = server_client(llm)
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "none",
        "max_tokens": 2,
    }
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    served = fake.requests[-1][0]
    assert not llm.tokenizer.decode(served).startswith("tools:")
    assert (
        served
        == PromptTokenizer(model_dir).token_ids("/v1/chat/completions", body)
        == llm.chat(MESSAGES, SamplingParams(max_tokens=1))[0].prompt_token_ids
    )
