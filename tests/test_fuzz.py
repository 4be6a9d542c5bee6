"""API fuzzing (schemathesis) against a live server on a tiny model: bodies generated from the
server's own OpenAPI document, bodies that break it, and hostile raw bodies, on every
operation; a bounded seeded run (`tandem bench fuzz` is the long one). No 5xx, every request
answered within 30 s, the server serving afterwards (with an API key: the fuzzer sends it,
so the cases reach past the key check), the Responses and Messages APIs reached and a stored
response a 404 to another key."""

from __future__ import annotations

import pytest
from server_fixture import running_server
from structured_fixture import with_tokenizer

from tandem.bench.fuzz import run_fuzz
from tandem.config import EngineConfig
from tandem.server.state import ServerConfig

pytest.importorskip("schemathesis")


@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    model = with_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("fuzz") / "m")
    engine = EngineConfig.from_kwargs(
        model=model, dtype="float32", kv_cache_memory=1 << 20, max_model_len=64
    )
    with running_server(
        engine,
        ServerConfig(
            model_name="tiny", max_n=4, api_key="sesame", api_key_classes={"other": "standard"}
        ),
    ) as (
        url,
        _,
    ):
        yield url


def test_openapi_describes_the_real_request_models(server):
    import httpx

    assert httpx.get(server + "/openapi.json").status_code == 401  # behind the key, as every route
    doc = httpx.get(server + "/openapi.json", headers={"Authorization": "Bearer sesame"}).json()
    schemas = doc["components"]["schemas"]
    completion = schemas["CompletionRequest"]
    assert completion["additionalProperties"] is False  # an unknown field is refused, and says so
    assert {"prompt", "guided_json", "structured_outputs", "priority", "precision"} <= set(
        completion["properties"]
    )
    assert schemas["StructuredOutputsField"]["properties"]["json"]  # the alias, as clients send it
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["maxItems"] == 2048
    posts = {p for p, ops in doc["paths"].items() if "post" in ops}
    assert posts == {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/tokenize",
        "/detokenize",
        "/tandem/role",
        "/tandem/kv_group",
        "/tandem/prefill",
        "/tandem/decode",
        "/tandem/migrate",
    }
    assert all("requestBody" in doc["paths"][p]["post"] for p in posts)


def test_bounded_fuzz_run_finds_no_5xx(server):
    report = run_fuzz(
        server, cases=300, seed=0, api_key="sesame", timeout=30.0, other_api_key="other"
    )
    assert report["cases"] >= 250
    assert report["server_errors"] == [], report["server_errors"]
    assert report["unanswered"] == [], report["unanswered"]
    assert report["slowest_s"] < 30 and report["serving_after"]
    assert (
        report["statuses"].get("200", 0) > 0 and report["statuses"].get("400", 0) > 0
    )  # both sides reached
    paths = report["by_path"]
    for path in ("POST /v1/responses", "POST /v1/messages"):  # the new APIs are fuzzed too
        assert sum(paths[path].values()) >= 10, (path, paths[path])
    assert set(paths["GET /v1/responses/{response_id}"]) == {"404"}  # made-up ids: none stored
    assert paths["POST /v1/responses"].get("200"), paths["POST /v1/responses"]
    assert report["stored_response_private"] is True
