"""The Responses and Messages routes over a fake engine that writes a given output a character at
a time, with tools: a named tool_choice echoed in the response, text around a call streamed as
separate pieces, the stored conversation."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from route_fixture import Writes
from test_reasoning import sse
from test_server_routes import client_for

from tandem.server.routes import responses_api

TOOL = {
    "type": "function",
    "name": "f",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
}
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
