"""P/D through the router on tiny in-process instances (KV over shared memory), the plain way
when the prefill side is gone, and elastic role switches that drain first."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from cluster_fixture import router_for, tiny_cluster, tiny_instance


def body(prompt, max_tokens=6, **kw):
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **kw}


def metric_sum(url: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics").text.splitlines()
               if line.startswith(name + "{"))


@pytest.fixture(scope="module")
def pd(tiny_model_dirs):
    with tiny_cluster(tiny_model_dirs["llama"], roles=["prefill", "decode", "decode"]) as c:
        yield c


def test_pd_request_is_one_normal_response(pd):
    url = pd[0]
    prompt = list(range(1, 300))
    r = httpx.post(url + "/v1/completions", json=body(prompt, 8), timeout=60)
    assert r.status_code == 200, r.text
    pre, dec = r.headers["x-tandem-instance"].split("+")
    assert pre == "tiny-url0" and dec in ("tiny-url1", "tiny-url2")
    out = r.json()
    assert out["usage"] == {"prompt_tokens": 299, "completion_tokens": 8, "total_tokens": 307}
    assert out["choices"][0]["finish_reason"] == "length"
    assert metric_sum(url, "tandem_router:kv_transfer_bytes_total") > 0
    assert metric_sum(url, "tandem:prefix_cache_hits_total") >= 288  # the decode side found the imported KV
    short = httpx.post(url + "/v1/completions", json=body([7] * 50, 3), timeout=60)  # an idle decode instance
    assert short.headers["x-tandem-instance"] in ("tiny-url1", "tiny-url2")  # prefills a short prompt itself


def test_pd_stream_has_one_id_and_every_token(pd):
    with httpx.stream("POST", pd[0] + "/v1/completions", timeout=60, json=body(
            list(range(5, 320)), 5, stream=True, stream_options={"include_usage": True})) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    assert "+" in s.headers["x-tandem-instance"]
    assert len({c["id"] for c in chunks}) == 1
    steps = [c for c in chunks if c["choices"]]
    assert len(steps) == 5 and steps[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_pd_burst_all_complete(pd):
    async def burst():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(c.post(pd[0] + "/v1/completions", json=body([i + 1] * 120, 10))
                                          for i in range(8)))
    rs = asyncio.run(burst())
    assert [r.status_code for r in rs] == [200] * 8
    assert all(r.json()["usage"]["completion_tokens"] == 10 for r in rs)


def test_prefill_gone_falls_back_to_the_plain_way(tiny_model_dirs):
    with tiny_cluster(tiny_model_dirs["llama"], roles=["prefill", "decode"], router={"poll_interval_s": 30}) as (url, router, insts):
        insts[0][2].should_exit = True  # the prefill instance stops; the router has not polled since
        time.sleep(0.5)
        r = httpx.post(url + "/v1/completions", json=body(list(range(1, 100)), 4), timeout=60)
        assert r.status_code == 200 and r.headers["x-tandem-instance"] == "tiny-url1"
        assert r.json()["usage"]["completion_tokens"] == 4


def test_elastic_switch_drains_then_switches(tiny_model_dirs):
    """A schedule asking for 2 prefill instances moves the elastic decode instance, but only
    after the long request it is running has finished."""
    d = tiny_model_dirs["llama"]
    with tiny_instance(d, role="prefill") as (u0, _, _), tiny_instance(d, role="decode") as (u1, _, _), \
            tiny_instance(d, role="decode", elastic=True) as (u2, _, _):
        done = []
        long = threading.Thread(target=lambda: done.append(
            httpx.post(u2 + "/v1/completions", json=body([3] * 20, 900), timeout=120)))
        long.start()
        assert wait_for(lambda: httpx.get(u2 + "/tandem/state").json()["num_running"] == 1)
        opts = {"elastic_schedule": [[0, 2]], "elastic_interval_s": 0.1}
        with router_for([{"name": "tiny", "model": d, "urls": [u0, u1, u2]}], opts) as (url, router):
            inst = router.pool.instances["tiny-url2"]
            assert wait_for(lambda: inst.state.draining, 3)
            assert inst.state.role == "decode" and long.is_alive()  # still running its request
            long.join(120)
            assert done[0].json()["usage"]["completion_tokens"] == 900
            assert wait_for(lambda: inst.state.role == "prefill" and not inst.state.draining, 10)
            assert httpx.get(u2 + "/tandem/state").json()["role"] == "prefill"
            assert metric_sum(url, "tandem_router:role_switches_total") == 1


def wait_for(cond, timeout=5.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False
