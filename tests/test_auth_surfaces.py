"""One key rule on every surface of `tandem serve`: with `api_key`, with only keys mapped to
request classes, or with both, every route but /health and the dashboard page needs one of
them (/v1, /tokenize, /metrics, /dashboard/data, /tandem/*); without keys all are open. CORS
headers only with `allowed_origins`; the request log holds no text unless asked."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tandem.config import EngineConfig
from tandem.engine.async_llm import AsyncLLM
from tandem.server.api_server import build_app
from tandem.server.auth import key_accepted
from tandem.server.state import ServerConfig

GUARDED = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 1}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("GET", "/metrics", None),
    ("GET", "/dashboard/data", None),
    ("GET", "/tandem/state", None),
]
OK = {"/tokenize": 400}  # past the key: the tiny model has no tokenizer
OPEN = ["/health", "/dashboard", "/dashboard/static/dashboard.js"]
KEYS = {
    "api_key only": ({"api_key": "sesame"}, ["sesame"]),
    "class keys only": (
        {"api_key_classes": {"k-int": "interactive", "k-bg": "background"}},
        ["k-int", "k-bg"],
    ),
    "both": (
        {"api_key": "sesame", "api_key_classes": {"k-int": "interactive"}},
        ["sesame", "k-int"],
    ),
}


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    llm = AsyncLLM(
        EngineConfig.from_kwargs(
            model=tiny_model_dirs["llama"],
            dtype="float32",
            kv_cache_memory=1 << 20,
            max_model_len=64,
        ),
        in_process=True,
    )
    yield llm
    llm.shutdown()


def call(client: TestClient, method: str, path: str, body, key: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return client.request(method, path, json=body, headers=headers)


@pytest.mark.parametrize("name", KEYS)
def test_every_surface_follows_the_keys(llm, name):
    options, keys = KEYS[name]
    with TestClient(build_app(llm, ServerConfig(model_name="tiny", **options))) as client:
        for method, path, body in GUARDED:
            for wrong in (None, "wrong", keys[0] + "x", keys[0][:-1]):
                r = call(client, method, path, body, wrong)
                assert r.status_code == 401, (path, wrong, r.text)
                assert r.json()["error"]["type"] == "authentication_error"
            for key in keys:
                assert call(client, method, path, body, key).status_code == OK.get(path, 200), (
                    path,
                    key,
                )
        for path in OPEN:
            assert client.get(path).status_code == 200, path


def test_without_keys_every_surface_is_open(llm):
    with TestClient(build_app(llm, ServerConfig(model_name="tiny"))) as client:
        for method, path, body in GUARDED:
            assert call(client, method, path, body).status_code == OK.get(path, 200), path


def test_key_check_is_exact():
    config = ServerConfig(
        model_name="tiny", api_key="sesame", api_key_classes={"k-int": "interactive"}
    )
    assert key_accepted(config, "Bearer sesame") and key_accepted(config, "Bearer k-int")
    assert not any(
        key_accepted(config, h)
        for h in (
            None,
            "",
            "sesame",
            "Bearer sesame ",
            "bearer sesame",
            "Bearer k-in",
            "Bearer interactive",
        )
    )
    assert key_accepted(ServerConfig(model_name="tiny"), None)


def test_cors_only_with_allowed_origins(llm):
    preflight = {
        "Origin": "http://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    with TestClient(build_app(llm, ServerConfig(model_name="tiny", api_key="sesame"))) as client:
        r = client.get("/health", headers={"Origin": "http://app.example"})
        assert "access-control-allow-origin" not in r.headers
        assert (
            "access-control-allow-origin"
            not in client.options("/v1/completions", headers=preflight).headers
        )
    config = ServerConfig(
        model_name="tiny", api_key="sesame", allowed_origins=["http://app.example"]
    )
    with TestClient(build_app(llm, config)) as client:
        r = client.options("/v1/completions", headers=preflight)  # the preflight needs no key
        assert (
            r.status_code == 200
            and r.headers["access-control-allow-origin"] == "http://app.example"
        )
        r = client.get(
            "/v1/models", headers={"Origin": "http://app.example", "Authorization": "Bearer sesame"}
        )
        assert r.headers["access-control-allow-origin"] == "http://app.example"
        r = client.options(
            "/v1/completions", headers={**preflight, "Origin": "http://evil.example"}
        )
        assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("log_text", [False, True])
def test_request_log_holds_text_only_when_asked(llm, tmp_path, log_text):
    log = tmp_path / "requests.jsonl"
    config = ServerConfig(model_name="tiny", request_log=str(log), request_log_text=log_text)
    with TestClient(build_app(llm, config)) as client:
        r = client.post(
            "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}
        )
        assert r.status_code == 200
    line = json.loads(log.read_text().splitlines()[-1])
    assert line["prompt_tokens"] == 3 and line["output_tokens"] == 3 and line["e2e_latency"] >= 0
    assert ("prompt" in line and "outputs" in line) == log_text
    if log_text:
        assert line["outputs"] == [r.json()["choices"][0]["text"]]
