"""The Responses and Messages routes over a fake engine that writes a given output a character at
a time, with tools: a named tool_choice echoed in the response, text around a call streamed as
separate pieces, the stored conversation."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fastapi import APIRouter
from route_fixture import Writes
from test_reasoning import QWEN3, THINK_OFF, sse
from test_server_routes import client_for, word_tokenizer

from tandem.server.protocol import ChatCompletionRequest
from tandem.server.response_store import ResponseStore
from tandem.server.responses_protocol import ResponsesRequest
from tandem.server.routes import chat, messages, responses_api, tokenize
from tandem.server.tool_parsers.generic import GenericToolParser

TOOL = {
    "type": "function",
    "name": "f",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
}
HI = [{"role": "user", "content": "hi"}]
GENERIC_CALL = '{"tool_calls": [{"name": "f", "arguments": {"a": 1}}]}'


def served(router, text: str, parser: str | None = None):
    """A route over an engine writing `text`, its constraints compiled by no one."""
    client, state = client_for(router, Writes(text))

    async def compiled(_):
        return None

    counter = SimpleNamespace(labels=lambda *_: SimpleNamespace(inc=lambda: None))
    state.facts.compile_grammar = compiled
    state.metrics = SimpleNamespace(structured_requests=counter)
    state.config.tool_call_parser = parser
    return client, state


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_responses_named_tool_choice_is_echoed_and_stored(stream):
    client, state = served(responses_api.router, GENERIC_CALL)
    choice = {"type": "function", "name": "f"}
    body = {"input": "hi", "tools": [TOOL], "tool_choice": choice, "stream": stream}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    answer = sse(r)[-1]["response"] if stream else r.json()
    assert answer["tool_choice"] == choice
    assert [(i["type"], i.get("name")) for i in answer["output"]] == [("function_call", "f")]
    assert state.responses.get(None, answer["id"]).body == answer
    assert json.loads(answer["output"][0]["arguments"]) == {"a": 1}


SPLIT = 'Let me check. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call> Done.'


def test_responses_stream_text_around_a_call_is_two_messages():
    client, state = served(responses_api.router, SPLIT, "hermes")
    r = client.post("/v1/responses", json={"input": "hi", "tools": [TOOL], "stream": True})
    events = sse(r)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    shown = [i["content"][0]["text"] if i["type"] == "message" else i["name"] for i in done]
    assert shown == ["Let me check. ", "f", "Done."]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == "Let me check. Done."
    answer = events[-1]["response"]
    assert answer["output"] == done
    turn = state.responses.get(None, answer["id"]).messages[-1]
    assert turn["content"] == "Let me check. Done." and len(turn["tool_calls"]) == 1


def test_messages_stream_text_around_a_call_is_two_text_blocks():
    client, _ = served(messages.router, SPLIT, "hermes")
    tool = {"name": "f", "input_schema": TOOL["parameters"]}
    body = {"model": "m", "max_tokens": 5, "messages": HI, "tools": [tool], "stream": True}
    events = sse(client.post("/v1/messages", json=body))
    blocks = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    texts = [e["delta"].get("text") for e in events if e["type"] == "content_block_delta"]
    assert blocks == ["text", "tool_use", "text"]
    assert "".join(t for t in texts if t) == "Let me check. Done."
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_chat_stream_text_around_a_call():
    client, _ = served(chat.router, SPLIT, "hermes")
    tool = {"type": "function", "function": {"name": "f", "parameters": TOOL["parameters"]}}
    body = {"messages": HI, "tools": [tool], "stream": True}
    chunks = [c for c in sse(client.post("/v1/chat/completions", json=body)) if c["choices"]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    pieces = [d.get("content") or d["tool_calls"][0]["function"]["name"] for d in deltas[1:]]
    assert "".join(pieces) == "Let me check. fDone."
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_strict_hint_and_a_null_description_leave_the_prompt_as_it_is():
    function = {"name": "f", "parameters": TOOL["parameters"]}
    prompts = []
    for extra in ({}, {"strict": True}, {"strict": False, "description": None}):
        tool = {"type": "function", "function": {**function, **extra}}
        req = ChatCompletionRequest.model_validate({"messages": HI, "tools": [tool]})
        prompts.append(req.chat_prompt(word_tokenizer(), GenericToolParser()))
    assert prompts[0] == prompts[1] == prompts[2] and "You can call these tools" in prompts[0]
    assert "description" not in prompts[0]


def test_count_tokens_and_tokenize_count_the_prompt_a_request_runs_on():
    """With --tool-call-parser (earlier calls shown as the family's, not in words) and
    --reasoning-budget 0 (the template's thinking switch off)."""
    router = APIRouter()
    for one in (chat.router, messages.router, tokenize.router):
        router.include_router(one)
    client, state = served(router, "ok", "hermes")
    state.config.reasoning_budget = 0
    state.facts.max_model_len = 1000
    state.facts.tokenizer.chat_template += THINK_OFF
    use = {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}
    turns = [*HI, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
    body = {"model": "m", "messages": turns, "tools": [{"name": "f", "input_schema": {}}]}
    counted = client.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
    assert client.post("/v1/messages", json={**body, "max_tokens": 2}).status_code == 200
    assert counted == len(state.llm.requests[-1][0])
    call = {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = [*HI, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "content": "sunny"}]
    body = {"messages": turns, "tools": [{"type": "function", "function": {"name": "f"}}]}
    tokens = client.post("/tokenize", json=body).json()["tokens"]
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert tokens == state.llm.requests[-1][0]


def test_a_replayed_reasoning_item_keeps_its_reasoning():
    client, state = served(responses_api.router, QWEN3)
    state.config.reasoning_parser = "qwen3"
    answer = client.post("/v1/responses", json={"input": "hi"}).json()
    output, thought = answer["output"], word_tokenizer().encode("The user greets.\n")
    assert answer["usage"]["output_tokens_details"]["reasoning_tokens"] == len(thought)
    summary = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "In short."}]}
    for reasoning, shown in ((output[0], "The user greets.\n"), (summary, "In short.")):
        req = ResponsesRequest.model_validate({"input": [*HI, reasoning, output[1]]})
        turn = {"role": "assistant", "content": "Hello!", "reasoning_content": shown}
        assert req.messages() == [*HI, turn]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_response_too_large_to_keep_says_store_false(stream):
    client, state = served(responses_api.router, "ok")
    state.responses = ResponseStore(10, 100, 60)  # no response fits in 100 bytes
    r = client.post("/v1/responses", json={"input": "hi", "stream": stream})
    answer = sse(r)[-1]["response"] if stream else r.json()
    assert answer["store"] is False and answer["output"][0]["content"][0]["text"] == "ok"
    assert client.get(f"/v1/responses/{answer['id']}").status_code == 404
