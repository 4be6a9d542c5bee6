"""Reasoning models: <think>...</think> split from the answer (opened in the output, as Qwen3's,
or in the prompt, as DeepSeek-R1's), whole and streamed a character at a time, cut off, with tool
calls after it; through the chat (reasoning_content), Messages (thinking blocks) and Responses
(reasoning items) routes over a fake engine that writes a reasoning model's output; the
reasoning budget 0 turning the template's thinking switch off, and a budget of N reaching the
engine (tests/test_thinking_budget.py: what the engine does with it)."""

from __future__ import annotations

import json

import pytest
from route_fixture import Writes
from test_server_routes import client_for, word_tokenizer

from tandem.core.sampling_params import ThinkingBudget
from tandem.server.reasoning_parser import ThinkParser, reasoning_parser
from tandem.server.routes import chat, messages, responses_api
from tandem.server.tool_calls import ToolCallPlan, read_output
from tandem.server.tool_parsers.hermes import HermesToolParser

QWEN3 = "<think>\nThe user greets.\n</think>\n\nHello!"
R1 = "The user greets.\n</think>\n\nHello!"  # DeepSeek-R1: <think> ends the prompt
CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
THINK_OFF = "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" + THINK_OFF


@pytest.mark.parametrize(
    "opened,text,reasoning,answer",
    [
        (False, QWEN3, "The user greets.\n", "Hello!"),
        (True, R1, "The user greets.\n", "Hello!"),
        (False, "Hello!", "", "Hello!"),
        (False, "<think>cut off", "cut off", ""),
        (True, "cut off", "cut off", ""),
    ],
)
def test_think_split_whole_and_streamed(opened, text, reasoning, answer):
    parser = ThinkParser(opened)
    assert parser.split(text, final=True) == (reasoning, answer)
    sent = ("", "")
    for i in range(1, len(text) + 1):
        got = parser.split(text[:i], final=i == len(text))
        assert got[0].startswith(sent[0]) and got[1].startswith(sent[1]), (text[:i], got, sent)
        sent = got
    assert sent == (reasoning, answer)


def test_reasoning_then_tool_calls():
    plan = ToolCallPlan(HermesToolParser(), None)
    got = read_output(f"<think>need f</think>\n{CALL}", plan, True, ThinkParser(False))
    assert (got.reasoning, got.content, got.calls) == ("need f", "", [("f", {"a": 1})])


def test_the_parser_comes_from_the_template_or_the_flag():
    tok = word_tokenizer()
    assert reasoning_parser(None, tok, "user: hi") is None
    assert reasoning_parser("qwen3", tok, "user: hi") == ThinkParser(False)
    tok.chat_template = "{{ '<think>' }}"
    assert reasoning_parser(None, tok, "assistant: <think>\n") == ThinkParser(True)


def served(router, text: str = QWEN3):
    client, state = client_for(router, Writes(text))
    state.config.reasoning_parser = "qwen3"
    return client, state


def sse(r) -> list[dict]:
    return [
        json.loads(line.split("data: ", 1)[1])
        for line in r.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def test_chat_reasoning_content_whole_and_streamed():
    client, _ = served(chat.router)
    body = {"messages": [{"role": "user", "content": "hi"}]}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("The user greets.\n", "Hello!")
    chunks = sse(client.post("/v1/chat/completions", json={**body, "stream": True}))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "The user greets.\n"
    assert "".join(d.get("content") or "" for d in deltas) == "Hello!"


def test_messages_thinking_blocks_and_responses_reasoning_items():
    client, _ = served(messages.router)
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    content = client.post("/v1/messages", json=body).json()["content"]
    assert content == [
        {"type": "thinking", "thinking": "The user greets.\n", "signature": ""},
        {"type": "text", "text": "Hello!"},
    ]
    client, _ = served(responses_api.router)
    output = client.post("/v1/responses", json={"input": "hi"}).json()["output"]
    assert output[0]["type"] == "reasoning"
    assert output[0]["content"][0]["text"] == "The user greets.\n"
    assert output[1]["content"][0]["text"] == "Hello!"
    events = sse(client.post("/v1/responses", json={"input": "hi", "stream": True}))
    kinds = [e["type"] for e in events]
    assert "response.reasoning_text.delta" in kinds and kinds[-1] == "response.completed"
    assert events[-1]["response"]["output"][0]["type"] == "reasoning"


def test_reasoning_budget_0_turns_the_templates_switch_off():
    client, state = served(chat.router)
    state.facts.tokenizer.chat_template = TEMPLATE
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert state.llm.requests[-1][0] == word_tokenizer().encode("user: hi\n")
    state.config.reasoning_budget = 0
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert state.llm.requests[-1][0] == word_tokenizer().encode("user: hi\n<think></think>")


def test_thinking_token_budget_reaches_the_engine_for_a_reasoning_model():
    client, state = served(chat.router)
    tok = state.facts.tokenizer
    ids = [tuple(tok.encode(m, add_special_tokens=False)) for m in ("<think>", "</think>")]
    hi = {"messages": [{"role": "user", "content": "hi"}]}

    def budget(body: dict):
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        return state.llm.requests[-1][1].thinking_budget

    assert budget(hi) is None  # -1: unlimited
    assert budget({**hi, "thinking_token_budget": 5}) == ThinkingBudget(5, *ids)
    state.config.reasoning_budget = 7
    assert budget(hi) == ThinkingBudget(7, *ids)
    assert budget({**hi, "thinking_token_budget": 2}).tokens == 2  # the request's wins
    state.config.reasoning_parser = None  # a model that does not reason: nothing to end
    assert budget({**hi, "thinking_token_budget": 2}) is None
    assert client.post("/v1/chat/completions", json={**hi, "thinking_token_budget": -1}).is_error


def test_anthropic_thinking_is_the_budget_or_the_switch():
    client, state = served(messages.router)
    state.facts.tokenizer.chat_template = TEMPLATE
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}

    def sent(thinking: dict):
        assert client.post("/v1/messages", json={**body, "thinking": thinking}).status_code == 200
        return state.llm.requests[-1]

    assert sent({"type": "enabled", "budget_tokens": 3})[1].thinking_budget.tokens == 3
    prompt, params = sent({"type": "disabled"})
    assert prompt == word_tokenizer().encode("user: hi\n<think></think>")
    assert params.thinking_budget is None
