"""End to end through a live `tandem serve` with the official openai client, plus bad input,
overload, API keys and KV blocks returned after client disconnects."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
from server_fixture import running_server

from tandem.config import EngineConfig
from tandem.server.api_server import ServerConfig

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "requests.jsonl"
    engine = EngineConfig.from_kwargs(model=MODEL, kv_cache_memory=64 << 20, max_model_len=1024)
    with running_server(engine, ServerConfig(model_name=MODEL, request_log=str(log))) as (url, llm):
        yield url, llm, log


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused")


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_streaming_chat(client):
    """The streamed deltas make up the text the same greedy request gets unstreamed."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text and text == whole.choices[0].message.content
    assert finish in ("stop", "length") and finish == whole.choices[0].finish_reason
    assert usage.completion_tokens > 0 and usage.prompt_tokens > 10


def test_completion_n2_logprobs_usage(client):
    out = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=8,
        n=2,
        temperature=0.8,
        seed=7,
        logprobs=3,
    )
    assert len(out.choices) == 2 and {c.index for c in out.choices} == {0, 1}
    for c in out.choices:
        assert len(c.logprobs.tokens) == 8 and len(c.logprobs.top_logprobs[0]) <= 4
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    assert out.usage.completion_tokens == 16 and out.usage.prompt_tokens == 4
    again = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, n=2, temperature=0.8, seed=7
    )
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded


def test_stop_strings_and_greedy_matches_offline(client, server):
    full = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0
    )
    ids = server[1].tokenize("1, 2, 3, 4,")
    assert full.choices[0].text  # the reference text
    stop_at = full.choices[0].text.split(",")[1]
    stopped = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop_at + ","]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == full.choices[0].text.split(stop_at + ",")[0]
    assert len(ids) > 0


def test_stream_completion_text_equals_nonstream(client):
    kw = dict(model=MODEL, prompt="The ocean is", max_tokens=12, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices
    )
    assert streamed == whole


def test_models_tokenize_health_metrics(server):
    url = server[0]
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == MODEL
    assert httpx.get(url + "/health").status_code == 200
    toks = httpx.post(url + "/tokenize", json={"prompt": "hello world"}).json()
    assert toks["count"] == len(toks["tokens"]) > 0
    assert (
        httpx.post(url + "/detokenize", json={"tokens": toks["tokens"]}).json()["prompt"]
        == "hello world"
    )
    for name in (
        "tandem:time_to_first_token_seconds_count",
        "tandem:num_requests_running",
        "tandem:kv_cache_usage_perc",
        "tandem:prefix_cache_queries_total",
        "tandem:generation_tokens_total",
        "tandem:num_requests_waiting_by_level",
        "tandem:preemptions_by_mode_total",
        "tandem:request_queue_time_seconds_count",
    ):
        metric(url, name)


BAD = [
    (dict(content=b"{not json"), 400),
    (dict(json={"model": MODEL, "prompt": 5}), 400),
    (dict(json={"model": MODEL}), 400),
    (dict(json={"model": "gpt-17", "prompt": "x"}), 404),
    (dict(json={"model": MODEL, "prompt": "x", "max_tokens": 0}), 400),
    (dict(json={"model": MODEL, "prompt": "x", "max_tokens": 5000}), 400),
    (dict(json={"model": MODEL, "prompt": "hi " * 1200}), 400),
    (dict(json={"model": MODEL, "prompt": "x", "n": 1000}), 400),
    (dict(json={"model": MODEL, "prompt": "x", "temperature": -1}), 400),
    (dict(json={"model": MODEL, "prompt": "x", "top_p": 2}), 400),
    (dict(json={"model": MODEL, "prompt": ""}), 400),
    (dict(json={"model": MODEL, "prompt": [10**9]}), 400),
    (dict(content=b"x" * (5 << 20), headers={"content-type": "application/json"}), 413),
]


@pytest.mark.parametrize("kwargs,status", BAD)
def test_bad_input_gets_openai_error_and_server_keeps_serving(server, kwargs, status):
    url = server[0]
    r = httpx.post(url + "/v1/completions", timeout=30, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    ok = httpx.post(
        url + "/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2}, timeout=30
    )
    assert ok.status_code == 200


def test_unknown_route_and_bad_chat(server):
    url = server[0]
    assert httpx.get(url + "/v2/nothing").status_code == 404
    assert "error" in httpx.get(url + "/v2/nothing").json()
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400


def test_disconnects_return_every_block(server):
    url, llm, log = server

    async def one(i: int):
        body = {
            "model": MODEL,
            "prompt": f"Story number {i}:",
            "max_tokens": 40,
            "ignore_eos": True,
            "stream": True,
        }
        async with httpx.AsyncClient(timeout=60) as c:
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                n = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        n += 1
                        if i % 3 == 0 and n == 3:
                            return "disconnected"
                return "done"

    async def run():
        return await asyncio.gather(*(one(i) for i in range(9)))

    results = asyncio.run(run())
    assert results.count("disconnected") == 3 and results.count("done") == 6
    deadline = time.time() + 10
    while time.time() < deadline:
        if (
            metric(url, "tandem:kv_cache_free_blocks")
            == metric(url, "tandem:kv_cache_total_blocks")
            and metric(url, "tandem:num_requests_running") == 0
        ):
            break
        time.sleep(0.1)
    assert metric(url, "tandem:kv_cache_free_blocks") == metric(url, "tandem:kv_cache_total_blocks")
    assert metric(url, "tandem:num_requests_waiting") == 0
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert {
        "arrival_time",
        "prompt_tokens",
        "output_tokens",
        "cached_prompt_tokens",
        "priority",
        "queue_time",
        "ttft",
        "mean_itl",
        "e2e_latency",
        "finish_reason",
    } <= set(lines[-1])
    assert sum("abort" in x["finish_reason"] for x in lines) >= 3


def test_overload_429_and_api_key(tiny_model_dirs):
    engine = EngineConfig.from_kwargs(
        model=tiny_model_dirs["llama"], dtype="float32", kv_cache_memory=1 << 22, max_num_seqs=1
    )
    with running_server(
        engine, ServerConfig(model_name="tiny", api_key="sesame", max_waiting=2)
    ) as (url, _):
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body).status_code == 401
        headers = {"Authorization": "Bearer sesame"}

        async def burst():
            async with httpx.AsyncClient(timeout=60, headers=headers) as c:
                return await asyncio.gather(
                    *(c.post(url + "/v1/completions", json=body) for _ in range(8))
                )

        responses = asyncio.run(burst())
        codes = [r.status_code for r in responses]
        assert 429 in codes and 200 in codes
        limited = next(r for r in responses if r.status_code == 429)
        assert (
            limited.headers["retry-after"] and limited.json()["error"]["type"] == "rate_limit_error"
        )
        assert httpx.get(url + "/health").status_code == 200  # not behind the key
