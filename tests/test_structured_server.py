"""Structured outputs and tool calls through a live server on a tiny random model (with a real
tokenizer): every request field form, streamed and not, on both endpoints; bad input is a 400
naming the problem and the server keeps serving; unknown fields are refused, not ignored."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from server_fixture import running_server
from structured_fixture import with_tokenizer

from tandem.config import EngineConfig
from tandem.server.api_server import ServerConfig

MODEL = "tiny"
SCHEMA = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["c", "f"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["unit", "ok", "tags"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {
        "type": "function",
        "function": {
            "name": "noop",
            "parameters": {
                "type": "object",
                "properties": {"v": {"enum": [1, 2]}},
                "required": ["v"],
                "additionalProperties": False,
            },
        },
    },
]
CHAT = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    path = with_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("sos") / "tiny-tok")
    engine = EngineConfig.from_kwargs(model=path, kv_cache_memory=1 << 22, dtype="float32")
    with running_server(engine, ServerConfig(model_name=MODEL)) as (url, llm):
        yield url, llm


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(
        url + path, json={"model": MODEL, "temperature": 0, "max_tokens": 60, **body}, timeout=60
    )


def _stream_text(url: str, path: str, body: dict) -> tuple[str, str, list[dict]]:
    """(text, finish_reason, tool-call deltas) of a streamed request."""
    text, finish, calls = "", None, []
    with httpx.stream(
        "POST",
        url + path,
        json={"model": MODEL, "temperature": 0, "max_tokens": 60, "stream": True, **body},
        timeout=60,
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
                calls += (c.get("delta") or {}).get("tool_calls") or []
                finish = c.get("finish_reason") or finish
    return text, finish, calls


CONSTRAINTS = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": SCHEMA, "strict": True},
            }
        },
        lambda t: jsonschema.validate(json.loads(t), SCHEMA),
    ),
    (
        {"response_format": {"type": "json_object"}},
        lambda t: isinstance(json.loads(t), dict) or 1 / 0,
    ),
    (
        {"structured_outputs": {"regex": "[a-c]{2}[0-9]{3}"}},
        lambda t: re.fullmatch("[a-c]{2}[0-9]{3}", t) or 1 / 0,
    ),
    (
        {"structured_outputs": {"choice": ["red", "green"]}},
        lambda t: t in ("red", "green") or 1 / 0,
    ),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ({"guided_regex": "(yes|no)!"}, lambda t: t in ("yes!", "no!") or 1 / 0),
    ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down") or 1 / 0),
    (
        {"guided_grammar": 'root ::= "<" [a-z] [a-z]? ">"'},
        lambda t: re.fullmatch("<[a-z]{1,2}>", t) or 1 / 0,
    ),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_every_constraint_field_on_both_endpoints(server, endpoint, stream):
    url, _ = server
    prompt = {"prompt": "Answer:"} if endpoint == "/v1/completions" else {"messages": CHAT}
    for fields, check in CONSTRAINTS:
        body = {**prompt, **fields}
        if stream:
            text, finish, _ = _stream_text(url, endpoint, body)
        else:
            r = _post(url, endpoint, body)
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            text, finish = (
                c.get("text", (c.get("message") or {}).get("content")),
                c["finish_reason"],
            )
        if fields.get("response_format", {}).get("type") == "json_object" and finish == "length":
            continue  # any-object JSON may run past max_tokens on a random model
        assert finish == "stop", (fields, text)
        check(text)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_tool_calls_forced_by_schema(server, choice, stream):
    url, _ = server
    body = {
        "messages": CHAT,
        "tools": TOOLS,
        "tool_choice": choice,
        "n": 2,
        "temperature": 1.0,
        "seed": 3,
        "parallel_tool_calls": False,
        "max_tokens": 200,
    }
    if stream:
        text, finish, calls = _stream_text(url, "/v1/chat/completions", body)
        assert finish == "tool_calls" and text == "" and calls and all("index" in c for c in calls)
    else:
        r = _post(url, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        calls = []
        for c in r.json()["choices"]:
            assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
            calls += c["message"]["tool_calls"]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        if choice != "required":
            assert call["function"]["name"] == "get_weather"
        jsonschema.validate(
            json.loads(call["function"]["arguments"]), params[call["function"]["name"]]
        )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_tool_choice_auto_answers_or_calls(server, stream):
    """The tiny model's template knows no tools: the generic format, whose output either
    answers (content) or calls (tool_calls), each well formed."""
    url, _ = server
    body = {
        "messages": CHAT,
        "tools": TOOLS,
        "n": 6,
        "temperature": 1.0,
        "seed": 1,
        "max_tokens": 200,
    }
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    if stream:
        text, finish, calls = _stream_text(url, "/v1/chat/completions", body)
        assert finish in ("stop", "length", "tool_calls")
    else:
        r = _post(url, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        calls = [call for c in r.json()["choices"] for call in c["message"].get("tool_calls") or []]
        for c in r.json()["choices"]:
            assert (c["finish_reason"] == "tool_calls") == bool(c["message"].get("tool_calls"))
            if c["finish_reason"] != "length":  # (a call cut short is its text)
                assert not (c["message"]["content"] or "").startswith("{")
    for call in calls:
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, params[call["function"]["name"]])


def test_tool_choice_none_ignores_tools_and_user_is_accepted(server):
    r = _post(
        server[0],
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "tools": TOOLS,
            "tool_choice": "none",
            "user": "u1",
            "metadata": {"a": "b"},
            "max_tokens": 4,
        },
    )
    assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]


@pytest.mark.parametrize(
    "body, words",
    [
        ({"guided_json": {"type": "nope"}}, 'Unsupported type "nope"'),
        ({"structured_outputs": {"regex": "a(b"}}, "invalid regex constraint"),
        ({"guided_choice": []}, "choice must be a non-empty list"),
        ({"guided_grammar": "root ::= ("}, "invalid grammar constraint"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "needs a `json_schema` object"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "one output constraint, not several"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "'nope', which is not in tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"},
            "tool calls force their own output schema",
        ),
        ({"use_beam_search": True}, "unsupported field `use_beam_search`: beam search"),
        ({"tool_choice": "required"}, "tool_choice needs `tools`"),
        (
            {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}},
            "unsupported field `structured_outputs.whitespace_pattern`",
        ),
        ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens cannot be combined"),
    ],
)
def test_bad_input_is_a_400_naming_it_and_the_server_keeps_serving(server, body, words):
    url, _ = server
    r = _post(url, "/v1/chat/completions", {"messages": CHAT, **body})
    assert r.status_code == 400, r.text
    assert re.search(words, r.json()["error"]["message"]), r.json()
    ok = _post(url, "/v1/completions", {"prompt": "x", "guided_choice": ["a", "b"]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("a", "b")


def test_logprobs_of_masked_tokens_stay_valid_json(server):
    url, _ = server
    r = _post(
        url,
        "/v1/chat/completions",
        {"messages": CHAT, "guided_choice": ["a"], "logprobs": True, "top_logprobs": 5},
    )
    assert r.status_code == 200, r.text
    tops = r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert tops[0]["token"] == "a" and [t["logprob"] for t in tops[1:]] == [-9999.0] * 4
    r = _post(url, "/v1/completions", {"prompt": "x", "guided_choice": ["a"], "logprobs": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["token_logprobs"][0] <= 0


def test_a_schema_too_large_to_compile_in_time_is_a_400(server):
    url, llm = server
    huge = {
        "type": "object",
        "properties": {
            f"p{i}": {
                "type": "object",
                "properties": {f"q{j}": {"enum": [f"v{k}" for k in range(50)]} for j in range(50)},
                "required": [f"q{j}" for j in range(50)],
            }
            for i in range(40)
        },
    }
    llm.engine_core.grammar_compiler.timeout_s = 0.2
    try:
        r = _post(url, "/v1/completions", {"prompt": "x", "guided_json": huge})
    finally:
        llm.engine_core.grammar_compiler.timeout_s = 10.0
    assert r.status_code == 400 and "did not compile within 0.2 s" in r.json()["error"]["message"]


def test_unsatisfiable_within_max_tokens_ends_by_length_and_metrics_count(server):
    url, _ = server
    r = _post(url, "/v1/completions", {"prompt": "x", "guided_regex": "[0-9]{40}", "max_tokens": 5})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    text = httpx.get(url + "/metrics").text
    assert re.search(
        r'^tandem:structured_output_requests_total\{kind="regex",model_name="tiny"\} [1-9]',
        text,
        re.M,
    )
    assert re.search(
        r'^tandem:structured_output_requests_total\{kind="tool_calls",model_name="tiny"\} [1-9]',
        text,
        re.M,
    )
    assert re.search(
        r'^tandem:grammar_compile_time_seconds_count\{kind="json",model_name="tiny"\} [1-9]',
        text,
        re.M,
    )


@pytest.mark.parametrize(
    "field, literal", [("temperature", "NaN"), ("top_p", "Infinity"), ("min_p", "-Infinity")]
)
def test_nan_and_infinity_in_a_float_field_are_a_400(server, field, literal):
    """JSON's NaN / Infinity literals (which Python's json reads) get a 400, not a sampler fault."""
    url, _ = server
    raw = f'{{"prompt": "x", "max_tokens": 2, "{field}": {literal}}}'
    r = httpx.post(
        url + "/v1/completions",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400 and "finite number" in r.text, r.text
