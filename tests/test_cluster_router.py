"""The router over tiny in-process instances: routing by model, bad input, no healthy instance,
prefix-aware and load-aware choices, retries when an instance goes away, aggregated metrics."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from cluster_fixture import router_for, tiny_cluster, tiny_instance, wait_for
from prometheus_client.parser import text_string_to_metric_families
from server_fixture import free_port

from tandem.cluster.router.prefix import prefix_hashes


def body(prompt, max_tokens=4, **kw):
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **kw}


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    with tiny_cluster(tiny_model_dirs["llama"], 3, router={"max_body_bytes": 1 << 16}) as c:
        yield c


def test_models_routing_and_stream_passthrough(cluster):
    url = cluster[0]
    assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["tiny"]
    assert httpx.get(url + "/health").json()["available_instances"] == {"tiny": 3}
    r = httpx.post(url + "/v1/completions", json=body([5, 6, 7], 6), timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    assert r.headers["x-tandem-instance"].startswith("tiny-")
    with httpx.stream(
        "POST", url + "/v1/completions", json=body([5, 6, 7], 6, stream=True), timeout=30
    ) as s:
        lines = [x for x in s.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) == 7
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "kwargs,status,text",
    [
        (dict(json=body([1, 2], model="gpt-17")), 404, "does not exist"),
        (dict(content=b"{nope"), 400, "invalid JSON"),
        (
            dict(content=b"[" * 20000 + b"]" * 20000),
            400,
            "invalid JSON",
        ),  # nested past the parser: not a 500
        (
            dict(content=b"x" * (1 << 17), headers={"content-type": "application/json"}),
            413,
            "larger than",
        ),
        (
            dict(json=body([10**9])),
            400,
            "outside the vocabulary",
        ),  # the instance's own 400, passed through
    ],
)
def test_bad_input(cluster, kwargs, status, text):
    r = httpx.post(cluster[0] + "/v1/completions", timeout=30, **kwargs)
    assert r.status_code == status, r.text
    assert text in r.json()["error"]["message"]
    assert (
        httpx.post(cluster[0] + "/v1/completions", json=body([1, 2]), timeout=30).status_code == 200
    )


def test_embeddings_to_a_chat_model_is_refused(cluster):
    r = httpx.post(cluster[0] + "/v1/embeddings", json={"model": "tiny", "input": "x"})
    assert r.status_code == 400 and "chat model" in r.json()["error"]["message"]


def test_prefix_aware_choice_follows_the_cache(cluster):
    url, router, _ = cluster
    prefixes = [[(7 * k + i) % 500 + 1 for i in range(96)] for k in range(3)]
    first = {}
    for k, p in enumerate(prefixes):
        r = httpx.post(url + "/v1/completions", json=body(p + [k + 1], 2), timeout=30)
        first[k] = r.headers["x-tandem-instance"]
    assert wait_for(
        lambda: sum(len(i.state.cached_prefixes) for i in router.pool.instances.values()) >= 18
    )
    for k, p in enumerate(prefixes):
        r = httpx.post(url + "/v1/completions", json=body(p + [k + 100, 3], 2), timeout=30)
        assert r.headers["x-tandem-instance"] == first[k]
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 80


def test_load_aware_burst_spreads(cluster):
    url = cluster[0]

    async def burst():
        async with httpx.AsyncClient(timeout=60) as c:
            rs = await asyncio.gather(
                *(c.post(url + "/v1/completions", json=body([400 + i] * 40, 30)) for i in range(6))
            )
        return [r.headers["x-tandem-instance"] for r in rs if r.status_code == 200]

    used = asyncio.run(burst())
    assert len(used) == 6 and len(set(used)) == 3


def test_aggregated_metrics(cluster):
    url = cluster[0]
    httpx.post(url + "/v1/completions", json=body([3, 4], 2), timeout=30)
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    routed = fams["tandem_router:requests_routed"].samples
    assert sum(s.value for s in routed if s.name.endswith("_total")) >= 1
    running = fams["tandem:num_requests_running"].samples
    assert sorted(s.labels["instance"] for s in running) == ["tiny-url0", "tiny-url1", "tiny-url2"]
    healthy = {
        s.labels["instance"]: s.value for s in fams["tandem_router:instance_healthy"].samples
    }
    assert healthy == {"tiny-url0": 1.0, "tiny-url1": 1.0, "tiny-url2": 1.0}


def test_no_healthy_instance_503(tiny_model_dirs):
    dead = f"http://127.0.0.1:{free_port()}"
    with router_for([{"name": "tiny", "model": "x", "urls": [dead]}]) as (url, _):
        r = httpx.post(url + "/v1/completions", json=body([1, 2]), timeout=30)
        assert r.status_code == 503
        msg = r.json()["error"]["message"]
        assert "no healthy instance" in msg and "tiny-url0" in msg
        assert httpx.get(url + "/health").status_code == 503


def refused(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=0.2)
        return False
    except httpx.ConnectError:
        return True


def test_instance_gone_retry_elsewhere_and_marked_unhealthy(tiny_model_dirs):
    with (
        tiny_instance(tiny_model_dirs["llama"]) as (u0, _, s0),
        tiny_instance(tiny_model_dirs["llama"]) as (u1, _, _),
    ):
        with router_for(
            [{"name": "tiny", "model": "x", "urls": [u0, u1]}], {"poll_interval_s": 30}
        ) as (url, router):
            p = list(range(1, 65))  # make the first instance the preferred one, then stop it
            router.pool.instances["tiny-url0"].state.cached_prefixes = frozenset(
                prefix_hashes(p, 16)
            )
            s0.should_exit = True
            assert wait_for(lambda: refused(u0))
            r = httpx.post(url + "/v1/completions", json=body(p + [1], 3), timeout=30)
            assert r.status_code == 200 and r.headers["x-tandem-instance"] == "tiny-url1"
            assert not router.pool.instances["tiny-url0"].state.healthy
            text = httpx.get(url + "/metrics").text
            assert 'tandem_router:retries_total{model_name="tiny",reason="connect"} 1.0' in text
