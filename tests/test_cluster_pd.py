"""P/D through the router on tiny in-process instances (KV over shared memory), the plain way
when the prefill side is gone, and elastic role switches that drain first."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import threading
import time

import httpx
import pytest
from cluster_fixture import (
    launched_cluster,
    router_for,
    tiny_cluster,
    tiny_instance,
    wait_for,
    with_word_tokenizer,
)

from tandem.executor.kv_transfer import ShmTransport


def body(prompt, max_tokens=6, **kw):
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **kw}


def metric_sum(url: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(url + "/metrics").text.splitlines()
        if line.startswith(name + "{")
    )


def no_kv_held(url: str) -> bool:
    """Every KV block of the instance free (cached ones count as free): none pinned for an
    import, reserved for a transfer or owned by a request."""
    return metric_sum(url, "tandem:kv_cache_free_blocks") == metric_sum(
        url, "tandem:kv_cache_total_blocks"
    )


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
    assert (
        metric_sum(url, "tandem:prefix_cache_hits_total") >= 288
    )  # the decode side found the imported KV
    short = httpx.post(
        url + "/v1/completions", json=body([7] * 50, 3), timeout=60
    )  # an idle decode instance
    assert short.headers["x-tandem-instance"] in (
        "tiny-url1",
        "tiny-url2",
    )  # prefills a short prompt itself


def test_pd_stream_has_one_id_and_every_token(pd):
    with httpx.stream(
        "POST",
        pd[0] + "/v1/completions",
        timeout=60,
        json=body(list(range(5, 320)), 5, stream=True, stream_options={"include_usage": True}),
    ) as s:
        chunks = [
            json.loads(x[6:])
            for x in s.iter_lines()
            if x.startswith("data: ") and x != "data: [DONE]"
        ]
    assert "+" in s.headers["x-tandem-instance"]
    assert len({c["id"] for c in chunks}) == 1
    steps = [c for c in chunks if c["choices"]]
    assert len(steps) == 5 and steps[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert set(chunks[-1]["metrics"]) == {
        "queue_time",
        "prefill_time",
        "decode_time",
    }  # as co-located


def test_a_field_the_split_cannot_carry_goes_the_plain_way(pd):
    """A grammar constraint (or any field outside PD_KEYS) is not dropped by the split: the
    request goes whole to one instance, which honours the field or refuses it in words (this
    tiny model has no tokenizer, so the constraint is refused; split, it was silently lost)."""
    r = httpx.post(
        pd[0] + "/v1/completions",
        timeout=60,
        json=body(
            list(range(1, 300)), 8, temperature=0, structured_outputs={"choice": ["yes", "no"]}
        ),
    )
    assert r.status_code == 400 and "structured outputs" in r.json()["error"]["message"]
    assert "+" not in r.headers.get("x-tandem-instance", "")


GREEDY = {"temperature": 0, "ignore_eos": True}


@contextlib.contextmanager
def prefill_stream(url: str, prompt: list[int], transfer_id: str):
    """POST /tandem/prefill, held open: (the NDJSON lines still to read, the first-token line)."""
    with httpx.stream(
        "POST",
        url + "/tandem/prefill",
        timeout=60,
        json={"prompt": prompt, "transfer_id": transfer_id, "sampling": GREEDY},
    ) as s:
        lines = s.iter_lines()
        yield lines, json.loads(next(lines))


def test_refused_decode_leg_still_takes_its_transfer(pd):
    """The prefill side sends once its first token is out; a decode leg refused before its
    receive still takes the transfer off the link (no file left, the send completes) and
    holds no block."""
    _, _, insts = pd
    pre, dec = insts[0][0], insts[1][0]
    prompt = list(range(1, 100))
    with prefill_stream(pre, prompt, "refused") as (lines, first):
        r = httpx.post(
            dec + "/tandem/decode",
            timeout=60,
            json={
                "prompt": prompt + first["token_ids"],
                "transfer_id": "refused",
                "sampling": {"temperature": -1},
            },
        )
        assert r.status_code == 400 and "temperature" in r.text
        sent = json.loads(next(lines))
    assert first["kv_blocks"] == len(prompt) // 16 and sent["kv_bytes"] > 0 and "error" not in sent
    assert wait_for(lambda: not ShmTransport().path("refused").exists())
    assert wait_for(lambda: no_kv_held(dec))
    for url in (pre, dec):  # not in a torch.distributed group: a peer rank is a clear 400
        r = httpx.post(
            url + f"/tandem/{'prefill' if url == pre else 'decode'}",
            timeout=60,
            json={"prompt": prompt, "transfer_id": "x", "kv_peer": 3},
        )
        assert r.status_code == 400 and "in no group" in r.json()["error"]["message"]


def test_decode_leg_refused_after_its_receive_gives_the_kv_back(pd):
    """The transfer arrived, then the front end refuses the decode request (a token outside the
    vocabulary): a 400, and the blocks reserved for the KV are free again."""
    _, _, insts = pd
    pre, dec = insts[0][0], insts[1][0]
    prompt = list(range(1, 100))
    with prefill_stream(pre, prompt, "refused-late") as (lines, _):
        r = httpx.post(
            dec + "/tandem/decode",
            timeout=60,
            json={"prompt": prompt + [10**9], "transfer_id": "refused-late", "sampling": GREEDY},
        )
        assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
        assert "error" not in json.loads(next(lines))  # the send completed: the decode side took it
    assert wait_for(lambda: no_kv_held(dec))


def test_pd_burst_all_complete(pd):
    async def burst():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(
                *(c.post(pd[0] + "/v1/completions", json=body([i + 1] * 120, 10)) for i in range(8))
            )

    rs = asyncio.run(burst())
    assert [r.status_code for r in rs] == [200] * 8
    assert all(r.json()["usage"]["completion_tokens"] == 10 for r in rs)


# two `tandem serve` processes (each with its engine-core process), or two Ray actors: 5-10 s each
@pytest.mark.slow
# gloo between local processes is test_kv_transfer.py's; the local launcher is the shm case's
@pytest.mark.parametrize("backend,connector", [("ray", "torch_dist"), ("local", "shm")])
def test_pd_across_processes_equals_colocated(tiny_model_dirs, tmp_path, backend, connector):
    """Prefill and decode in two processes (or two Ray actors on a one-node Ray head started
    here), the KV links in their engine-core processes: joined by gloo, the KV moves
    point-to-point (as it would between hosts), or over shared memory; the greedy tokens are
    those of a co-located run."""
    ray = pytest.importorskip("ray") if backend == "ray" else None
    engine = {"dtype": "float32", "kv_cache_memory": 4 << 20, "num_threads": 1}
    kv = {"connector": connector, **({"backend": "gloo"} if connector == "torch_dist" else {})}
    doc = {
        "log_dir": str(tmp_path),
        "backend": backend,
        "kv_transfer": kv,
        "models": [
            {
                "name": "tiny",
                "model": with_word_tokenizer(tiny_model_dirs["llama"], tmp_path / "m"),
                "roles": {"prefill": 1, "decode": 1},
                "engine": engine,
                "resources": {"num_cpus": 1},
            }
        ],
    }
    prompts = [
        list(range(1, 300)),
        [5, 9] * 150 + [3],
    ]  # over short_prefill_tokens: never decode-only
    greedy = {"temperature": 0}
    with launched_cluster(doc) as (url, router):
        ranks = [i.kv_rank for i in router.pool.instances.values()]
        assert sorted(ranks) == [0, 1] if connector == "torch_dist" else ranks == [None, None]
        assert ray is None or ray.is_initialized()  # the instances are Ray actors
        dec = router.pool.instances["tiny-1"].url
        for prompt in prompts:
            r = httpx.post(url + "/v1/completions", json=body(prompt, 12, **greedy), timeout=60)
            assert r.headers["x-tandem-instance"] == "tiny-0+tiny-1"
            plain = httpx.post(dec + "/v1/completions", json=body(prompt, 12, **greedy), timeout=60)
            assert r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
            assert r.json()["choices"][0]["text"].count("<") == 12
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            json=body(prompts[0], 12, stream=True, **greedy),
            timeout=60,
        ) as s:
            text = "".join(
                c["choices"][0]["text"]
                for c in map(
                    json.loads,
                    (
                        x[6:]
                        for x in s.iter_lines()
                        if x.startswith("data: ") and x != "data: [DONE]"
                    ),
                )
                if c["choices"]
            )
        plain = httpx.post(dec + "/v1/completions", json=body(prompts[0], 12, **greedy), timeout=60)
        assert text == plain.json()["choices"][0]["text"]
        assert wait_for(lambda: metric_sum(url, "tandem_router:kv_transfer_seconds_count") == 3)
        assert metric_sum(url, "tandem_router:kv_transfer_bytes_total") > 0
    assert ray is None or not ray.is_initialized()  # the head started here is stopped


def test_prefill_gone_falls_back_to_the_plain_way(tiny_model_dirs):
    with tiny_cluster(
        tiny_model_dirs["llama"], roles=["prefill", "decode"], router={"poll_interval_s": 30}
    ) as (url, router, insts):
        insts[0][
            2
        ].should_exit = True  # the prefill instance stops; the router has not polled since
        time.sleep(0.5)
        r = httpx.post(url + "/v1/completions", json=body(list(range(1, 100)), 4), timeout=60)
        assert r.status_code == 200 and r.headers["x-tandem-instance"] == "tiny-url1"
        assert r.json()["usage"]["completion_tokens"] == 4


def test_elastic_switch_drains_then_switches(tiny_model_dirs):
    """A schedule asking for 2 prefill instances moves the elastic decode instance, but only
    after the long request it is running has finished."""
    d = tiny_model_dirs["llama"]
    with (
        tiny_instance(d, role="prefill") as (u0, _, _),
        tiny_instance(d, role="decode") as (u1, _, _),
        tiny_instance(d, role="decode", elastic=True) as (u2, _, _),
    ):
        done = []
        long = threading.Thread(
            target=lambda: done.append(
                httpx.post(u2 + "/v1/completions", json=body([3] * 20, 900), timeout=120)
            )
        )
        long.start()
        assert wait_for(lambda: httpx.get(u2 + "/tandem/state").json()["num_running"] == 1)
        opts = {"elastic_schedule": [[0, 2]], "elastic_interval_s": 0.1}
        with router_for([{"name": "tiny", "model": d, "urls": [u0, u1, u2]}], opts) as (
            url,
            router,
        ):
            inst = router.pool.instances["tiny-url2"]
            assert wait_for(lambda: inst.state.draining, 3)
            assert inst.state.role == "decode" and long.is_alive()  # still running its request
            long.join(120)
            assert done[0].json()["usage"]["completion_tokens"] == 900
            assert wait_for(lambda: inst.state.role == "prefill" and not inst.state.draining, 10)
            assert httpx.get(u2 + "/tandem/state").json()["role"] == "prefill"
            assert metric_sum(url, "tandem_router:role_switches_total") == 1


def stream_tokens(url: str, req: dict, during=None) -> tuple[str, list[dict]]:
    """Stream a completion; `during(response id)` runs once after the third token."""
    chunks = []
    with httpx.stream(
        "POST", url + "/v1/completions", json={**req, "stream": True}, timeout=60
    ) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
                if during is not None and len(chunks) == 3:
                    during(chunks[0]["id"])
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), chunks


@pytest.fixture(scope="module")
def pd_words(tiny_model_dirs, tmp_path_factory):
    """P/D with a tokenizer whose text shows every token id: 1 prefill, 2 decode."""
    model = with_word_tokenizer(tiny_model_dirs["llama"], tmp_path_factory.mktemp("words") / "m")
    with tiny_cluster(model, roles=["prefill", "decode", "decode"]) as c:
        yield c


def test_migration_keeps_the_stream_whole(pd_words):
    """A decoding request moved to the other decode instance mid-stream (the operator's POST
    /tandem/migrate): one stream, every token once, the tokens of an unmoved run; the final
    chunk carries the latency split; no KV block is left held on either decode instance."""
    url, router, insts = pd_words
    req = body(list(range(1, 300)), 120, temperature=0, stream_options={"include_usage": True})
    reference = httpx.post(insts[1][0] + "/v1/completions", json=req, timeout=60).json()["choices"][
        0
    ]["text"]
    moves = []
    text, chunks = stream_tokens(
        url,
        req,
        lambda rid: moves.append(
            httpx.post(url + "/tandem/migrate", json={"request_id": rid}, timeout=10)
        ),
    )
    assert moves[0].status_code == 200, moves[0].text
    assert {moves[0].json()["from"], moves[0].json()["to"]} == {"tiny-url1", "tiny-url2"}
    assert text == reference and text.count("<") == 120
    assert chunks[-1]["usage"]["completion_tokens"] == 120
    assert set(chunks[-1]["metrics"]) == {"queue_time", "prefill_time", "decode_time"}
    assert metric_sum(url, "tandem_router:migrations_total") == 1
    # two KV transfers: the prefill side's and the move's
    assert wait_for(lambda: metric_sum(url, "tandem_router:kv_transfer_seconds_count") == 2)
    for dec, _, _ in insts[1:]:
        assert wait_for(functools.partial(no_kv_held, dec))


def test_migrate_bad_input(pd_words):
    url = pd_words[0]
    r = httpx.post(url + "/tandem/migrate", json={"request_id": "cmpl-nope"})
    assert r.status_code == 404 and "is decoding" in r.json()["error"]["message"]
    assert httpx.post(url + "/tandem/migrate", json={}).status_code == 422


@pytest.mark.slow  # three instances and a router: ~6-10 s
def test_a_decode_instance_short_of_kv_sheds_a_request(tiny_model_dirs, tmp_path):
    """The router moves a request by itself: it lands on a decode instance with a small KV
    pool (the roomy one is draining then), which runs short as the output grows; once the
    roomy one takes work again, the request moves there. The stream stays whole (the tokens
    of an unmoved run), the move is counted as `kv_short`, and no block is left held. The
    shortage mark is low, so the move comes early in a request that takes well under a second."""
    model = with_word_tokenizer(tiny_model_dirs["llama"], tmp_path / "m")
    opts = {
        "poll_interval_s": 0.05,
        "migration": {"interval_s": 0.05, "kv_usage": 0.35, "target_kv_usage": 0.3},
    }
    with (
        tiny_instance(model, role="prefill") as (u0, _, _),
        tiny_instance(model, role="decode", kv_cache_memory=60 * 16 * 512) as (u1, _, _),
        tiny_instance(model, role="decode") as (u2, _, _),
        router_for([{"name": "tiny", "model": model, "urls": [u0, u1, u2]}], opts) as (url, router),
    ):
        assert metric_sum(u1, "tandem:kv_cache_total_blocks") == 60
        req = body(
            list(range(1, 300)), 600, temperature=0
        )  # 19 blocks of 60 at first, 57 at the end
        reference = httpx.post(u2 + "/v1/completions", json=req, timeout=60).json()["choices"][0][
            "text"
        ]
        roomy_inst = router.pool.instances["tiny-url2"]
        roomy_inst.state.draining = True

        def undrain(rid: str) -> None:
            assert router.pd.chain.live[rid].dec.id == "tiny-url1"
            roomy_inst.state.draining = False

        text, _ = stream_tokens(url, req, undrain)
        assert text == reference and text.count("<") == 600
        moves = [
            line
            for line in httpx.get(url + "/metrics").text.splitlines()
            if line.startswith("tandem_router:migrations_total{")
        ]
        assert moves == [
            'tandem_router:migrations_total{instance="tiny-url1",model_name="tiny",'
            'reason="kv_short"} 1.0'
        ]
        for dec in (u1, u2):
            assert wait_for(functools.partial(no_kv_held, dec))
