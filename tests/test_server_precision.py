"""Precision chosen per request through the server: field, model suffix, class (priority or
API key), default; /v1/models lists the variants; an unknown precision is a 400 and the server
keeps serving; metrics and the request log say which precision served each request."""

from __future__ import annotations

import json
import logging

import httpx
from server_fixture import running_server

from tandem.config import EngineConfig, load_yaml
from tandem.server.api_server import ServerConfig

YAML = """serving:
  cache: {enabled: true, max_prefix_tokens: 4096, min_match_length: 0}
  quantization:
    default: int8
    fallback: fp16
    classes: {interactive: fp16, background: int4}
  server:
    api_key: sesame
    api_key_classes: {batch-key: background}
"""


def test_precision_per_request(tiny_model_dirs, tmp_path, caplog):
    path = tmp_path / "serving.yaml"
    path.write_text(YAML)
    with caplog.at_level(logging.WARNING):
        opts = load_yaml(path)
        server_opts = load_yaml(path, section="server")
    assert "not supported" not in caplog.text
    # bf16 activations, so the fp16 variant shares the int8 default's KV pool on any CPU
    engine = EngineConfig.from_kwargs(
        **opts
        | {"model": tiny_model_dirs["llama"], "kv_cache_memory": 1 << 22, "dtype": "bfloat16"}
    )
    log = tmp_path / "requests.jsonl"
    server = ServerConfig(model_name="tiny", request_log=str(log), **server_opts)
    key = {"Authorization": "Bearer sesame"}
    with running_server(engine, server) as (url, _):
        models = httpx.get(url + "/v1/models", headers=key).json()["data"]
        assert [m["id"] for m in models] == ["tiny", "tiny:int8", "tiny:fp16", "tiny:int4"]

        def complete(headers=key, **fields):
            body = {
                "model": "tiny",
                "prompt": [1, 2, 3, 4],
                "max_tokens": 3,
                "ignore_eos": True,
            } | fields
            return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)

        assert complete().status_code == 200  # default: int8
        assert complete(precision="int4").status_code == 200
        assert complete(model="tiny:fp16").status_code == 200
        assert complete(model="tiny:fp16", precision="int4").status_code == 200  # the field wins
        assert complete(priority="background").status_code == 200  # class -> int4
        assert complete(priority="interactive").status_code == 200  # class -> fp16
        assert (
            complete(headers={"Authorization": "Bearer batch-key"}).status_code == 200
        )  # key class -> int4
        bad = complete(precision="fp8")
        assert bad.status_code == 400
        assert (
            bad.json()["error"]["message"]
            == "precision 'fp8' is not served here; served: int8, fp16, int4"
        )
        assert complete(model="tiny:int2").status_code == 400
        assert complete(model="other:int4").status_code == 404
        assert complete().status_code == 200  # still serving
        metrics = httpx.get(url + "/metrics", headers=key).text  # /metrics follows the keys too
    served = [json.loads(line)["precision"] for line in log.read_text().splitlines()]
    assert served == ["int8", "int4", "fp16", "int4", "int4", "fp16", "int4", "int8"]
    assert 'tandem:requests_by_precision_total{model_name="tiny",precision="int4"} 4.0' in metrics
    assert 'tandem:requests_by_precision_total{model_name="tiny",precision="int8"} 2.0' in metrics
    assert 'tandem:model_weight_bytes{model_name="tiny",precision="int4"}' in metrics


def test_class_keys_alone_still_close_the_server(tiny_model_dirs):
    """api_key_classes without api_key: the class keys are the only keys, not an open server."""
    engine = EngineConfig.from_kwargs(model=tiny_model_dirs["llama"], kv_cache_memory=1 << 22)
    server = ServerConfig(model_name="tiny", api_key_classes={"batch-key": "background"})
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}
    with running_server(engine, server) as (url, _):
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 401
        ok = httpx.post(
            url + "/v1/completions",
            json=body,
            timeout=60,
            headers={"Authorization": "Bearer batch-key"},
        )
        assert ok.status_code == 200
