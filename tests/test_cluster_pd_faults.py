"""A P/D request whose decode leg fails loses nothing the client can tell: a leg refused (503,
KV short) or dropped (the instance dies mid-stream, or closes the stream early) is resumed on
another decode instance from the tokens the client has, and the stream is the one a run
without the failure would give from those tokens; with no instance left to resume on, the
stream ends with an error event, never a silent close. A decode instance that fails is not
routed to again until a poll begun after the failure finds it healthy."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from cluster_fixture import router_for, tiny_instance, wait_for, with_word_tokenizer
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from server_fixture import serving

from tandem.cluster.policy.routing import RoutingWeights
from tandem.cluster.router.pool import Instance, InstancePool

FAKE_TOKENS = [5, 6, 7]  # what the failing decode instance streams before it fails


def fake_decode(mode: dict, calls: list) -> FastAPI:
    """A decode instance with the most free KV (the router picks it first) whose legs fail as
    `mode["mode"]` says: refuse (503, KV short), die (the connection drops mid-stream) or cut
    (the stream closes cleanly before [DONE])."""
    app = FastAPI()

    @app.get("/tandem/state")
    def state():
        return {"role": "decode", "kv_free_tokens": 10**6, "block_size": 16}

    @app.post("/tandem/decode")
    async def decode(request: Request):
        calls.append(await request.json())
        if mode["mode"] == "refuse":
            return JSONResponse({"error": {"message": "40 KV blocks asked for, 3 free"}}, 503)

        async def legs():
            for i, t in enumerate(FAKE_TOKENS):
                chunk = {
                    "id": "x",
                    "choices": [{"index": 0, "text": f" <{t}>", "finish_reason": None}],
                }
                yield f"data: {json.dumps({**chunk, 'num_tokens': i + 1, 'token_ids': [t]})}\n\n"
                await asyncio.sleep(0.01)
            if mode["mode"] == "die":
                raise RuntimeError("the decode instance died")

        return StreamingResponse(legs(), media_type="text/event-stream")

    @app.post("/v1/completions")
    def plain():
        return JSONResponse({"error": {"message": "down"}}, 503)

    return app


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs, tmp_path_factory):
    """A real prefill and decode instance (words tokenizer: text shows every token id) and the
    fake decode instance. Yields (router url, Router, real decode url, mode, calls)."""
    model = with_word_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("words") / "m")
    mode, calls = {"mode": "refuse"}, []
    with (
        tiny_instance(model, role="prefill") as (u0, _, _),
        tiny_instance(model, role="decode") as (u1, _, _),
        serving(fake_decode(mode, calls)) as (u2, _),
        router_for([{"name": "tiny", "model": model, "urls": [u0, u1, u2]}]) as (url, router),
    ):
        yield url, router, u1, mode, calls


def ids(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"<(\d+)>", text)]


def stream(url: str, req: dict) -> tuple[list[int], list[dict], str]:
    with httpx.stream(
        "POST", url + "/v1/completions", json={**req, "stream": True}, timeout=60
    ) as s:
        assert s.status_code == 200
        lines = [x for x in s.iter_lines() if x.startswith("data: ")]
        served = s.headers["x-tandem-instance"]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(x[6:]) for x in lines[:-1]]
    return ids("".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))), chunks, served


def greedy(url: str, prompt: list[int], n: int) -> list[int]:
    r = httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    return ids(r.json()["choices"][0]["text"])


PROMPT = list(range(1, 300))  # past short_prefill_tokens: split, not prefilled by a decode instance
REQ = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("how", ["refuse", "die", "cut"])
def test_a_failed_decode_leg_is_resumed_on_another_instance(cluster, how):
    url, router, real, mode, calls = cluster
    fake = router.pool.instances["tiny-url2"]
    assert wait_for(lambda: fake.state.healthy)  # a poll after an earlier test's failure
    mode["mode"], before, failed_at = how, len(calls), fake.failed_at
    first = greedy(real, PROMPT, 1)
    got, chunks, served = stream(url, REQ)
    assert len(calls) == before + 1  # one leg went to the failing instance
    assert not any("error" in c for c in chunks)
    if how == "refuse":  # nothing reached the client from it: as an unmoved run on the real one
        assert got == greedy(real, PROMPT, 12) and served == "tiny-url0+tiny-url1"
    else:  # its tokens reached the client: the real one goes on from them
        assert got == first + FAKE_TOKENS + greedy(
            real, PROMPT + first + FAKE_TOKENS, 12 - 1 - len(FAKE_TOKENS)
        )
    assert (fake.failed_at > failed_at) == (how == "die")  # a dropped connection: marked failed


def test_with_no_instance_to_resume_on_the_stream_ends_with_an_error_event(cluster):
    url, router, _, mode, _ = cluster
    mode["mode"] = "die"
    assert wait_for(lambda: router.pool.instances["tiny-url2"].state.healthy)
    real = router.pool.instances["tiny-url1"]
    real.state.draining = True
    try:
        with httpx.stream(
            "POST", url + "/v1/completions", json={**REQ, "stream": True}, timeout=60
        ) as s:
            lines = [x for x in s.iter_lines() if x.startswith("data: ")]
        assert wait_for(lambda: router.pool.instances["tiny-url2"].state.healthy)
        r = httpx.post(
            url + "/v1/completions", json=REQ, timeout=60
        )  # not streamed: a 502 with the reason
    finally:
        real.state.draining = False
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert "no other decode instance can resume it" in error["message"] and error["code"] == 502
    assert (
        r.status_code == 502
        and "no other decode instance can resume it" in r.json()["error"]["message"]
    )


def test_a_poll_begun_before_a_failure_does_not_make_the_instance_healthy():
    answer = asyncio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        await answer.wait()
        return httpx.Response(200, json={"role": "decode"})

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            inst = Instance("d", "http://d", "tiny")
            pool = InstancePool([inst], RoutingWeights(), client)
            poll = asyncio.create_task(pool.poll_once())
            await asyncio.sleep(0.01)
            pool.mark_failed(inst, "connection refused")  # seen dead while the poll was out
            answer.set()
            await poll
            assert not inst.state.healthy
            await pool.poll_once()  # begun after the failure: healthy again
            assert inst.state.healthy and inst.last_error is None

    asyncio.run(run())


def test_one_timed_out_poll_leaves_an_instance_healthy_two_in_a_row_or_a_refusal_do_not():
    """A busy instance whose state poll times out once keeps its traffic; two timeouts in a row
    mark it, as a refused connection does at once; an answer resets the count."""
    script: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        what = script.pop(0)
        if what == "timeout":
            raise httpx.ReadTimeout("slow", request=request)
        if what == "refused":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"role": "both"})

    async def run() -> list[bool]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            inst = Instance("a", "http://a", "tiny")
            pool = InstancePool([inst], RoutingWeights(), client)
            seen = []
            for what in ["ok", "timeout", "ok", "timeout", "timeout", "ok", "refused"]:
                script.append(what)
                await pool.poll_once()
                seen.append(inst.state.healthy)
            return seen

    assert asyncio.run(run()) == [True, True, True, True, False, True, False]
