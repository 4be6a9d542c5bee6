"""Request fields that need a model, through a live server on a tiny random Llama (fp32, a real
tokenizer): `echo` with `logprobs` and `max_tokens: 0` (what lm-eval-harness sends) gives the
prompt's teacher-forced logprobs, `prompt_logprobs`, `best_of`, `logit_bias`,
`stream_options.continuous_usage_stats` and `return_tokens_as_token_ids`; and the `vllm:`
metrics."""

from __future__ import annotations

import json

import httpx
import pytest
from server_fixture import running_server
from structured_fixture import with_tokenizer
from test_prompt_logprobs import hf_logprobs

from tandem.config import EngineConfig
from tandem.server.api_server import ServerConfig
from tandem.server.engine_metrics import EngineCollector

MODEL = "tiny"
HI = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    path = with_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("fields") / "tiny")
    engine = EngineConfig.from_kwargs(model=path, kv_cache_memory=1 << 22, dtype="float32")
    with running_server(engine, ServerConfig(model_name=MODEL)) as (url, _):
        yield url, path


def post(url: str, path: str, **body) -> dict:
    r = httpx.post(url + path, json={"model": MODEL, "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, path: str, **body) -> list[dict]:
    with httpx.stream(
        "POST",
        url + path,
        json={"model": MODEL, "temperature": 0, "stream": True, **body},
        timeout=60,
    ) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_echo_with_max_tokens_0_is_the_prompts_teacher_forced_logprobs(server):
    url, path = server
    prompts = [[5, 9, 301, 44, 17, 250, 3], [12, 13, 14, 15]]
    body = post(url, "/v1/completions", prompt=prompts, echo=True, logprobs=1, max_tokens=0)
    assert body["usage"]["completion_tokens"] == 0
    for prompt, choice in zip(prompts, body["choices"]):
        ref = hf_logprobs(path, prompt)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) and choice["finish_reason"] == "length"
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for i, token in enumerate(prompt[1:], 1):
            assert lp["token_logprobs"][i] == pytest.approx(ref[i - 1, token].item(), abs=1e-4)
            assert max(lp["top_logprobs"][i].values()) == pytest.approx(
                ref[i - 1].max().item(), abs=1e-4
            )
        assert "".join(lp["tokens"]) == choice["text"]


def test_echo_streamed_equals_whole(server):
    url, _ = server
    body = dict(prompt="abc def", echo=True, logprobs=0, max_tokens=4, ignore_eos=True)
    whole = post(url, "/v1/completions", **body)["choices"][0]
    chunks = stream(url, "/v1/completions", **body)
    assert whole["text"].startswith("abc def")
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert tokens == whole["logprobs"]["tokens"] and offsets == whole["logprobs"]["text_offset"]


@pytest.mark.parametrize(
    "path,body",
    [("/v1/completions", {"prompt": "abc def"}), ("/v1/chat/completions", {"messages": HI})],
)
def test_prompt_logprobs(server, path, body):
    url, _ = server
    out = post(url, path, max_tokens=1, prompt_logprobs=2, **body)
    plp = out["prompt_logprobs"] if "messages" in body else out["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == out["usage"]["prompt_tokens"]
    for entry in plp[1:]:
        ranks = sorted(v["rank"] for v in entry.values() if v["rank"] is not None)
        assert 2 <= len(entry) <= 3 and ranks == [1, 2]


def test_best_of_answers_the_n_of_highest_cumulative_logprob(server):
    url, _ = server
    body = dict(prompt="abc", max_tokens=5, temperature=1.0, seed=7, ignore_eos=True)
    every = post(url, "/v1/completions", n=3, best_of=3, logprobs=0, **body)["choices"]
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in every]
    assert sums == sorted(sums, reverse=True)
    best = post(url, "/v1/completions", n=1, best_of=3, **body)["choices"]
    assert len(best) == 1 and best[0]["text"] == every[0]["text"] and best[0]["logprobs"] is None


def test_logit_bias_and_tokens_as_ids(server):
    url, _ = server
    out = post(
        url,
        "/v1/chat/completions",
        messages=HI,
        max_tokens=3,
        logit_bias={"77": 100},
        logprobs=True,
        return_tokens_as_token_ids=True,
        ignore_eos=True,
    )
    tokens = [t["token"] for t in out["choices"][0]["logprobs"]["content"]]
    assert tokens == ["token_id:77"] * 3


@pytest.mark.parametrize(
    "path,body",
    [("/v1/completions", {"prompt": "abc"}), ("/v1/chat/completions", {"messages": HI})],
)
def test_continuous_usage_stats_put_usage_in_every_chunk(server, path, body):
    url, _ = server
    chunks = stream(
        url,
        path,
        max_tokens=5,
        ignore_eos=True,
        **body,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all("usage" in c for c in chunks) and counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == chunks[-2]["usage"]


def test_vllm_named_metrics_beside_tandems(server):
    """What vLLM dashboards scrape, with Tandem's values."""
    url, _ = server
    post(url, "/v1/completions", prompt="abc", max_tokens=2)
    text = httpx.get(url + "/metrics").text
    series = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_preemptions_total",
        "e2e_request_latency_seconds_count",
        "time_to_first_token_seconds_count",
    ):
        tandem = {k: v for k, v in series.items() if k.startswith(f"tandem:{name}{{")}
        vllm = {k.replace("tandem:", "vllm:", 1): v for k, v in tandem.items()}
        assert tandem and all(series.get(k) == v for k, v in vllm.items()), name
    assert float(series['vllm:generation_tokens_total{model_name="tiny"}']) >= 2
    assert 'vllm:gpu_cache_usage_perc{model_name="tiny"}' in series


def test_a_scrape_reads_the_engine_state_once(server, monkeypatch):
    """The vLLM names are Tandem's families renamed as they are collected, not a second read."""
    url, _ = server
    calls = []
    collect = EngineCollector.collect

    def counted(self):
        calls.append(self)
        return collect(self)

    monkeypatch.setattr(EngineCollector, "collect", counted)
    text = httpx.get(url + "/metrics").text
    assert "vllm:num_requests_running" in text and "tandem:num_requests_running" in text
    assert len(calls) == 1
