"""Fault: a cluster of `tandem serve` processes (tiny model) started by the local launcher; one
instance is SIGKILLed under streaming load. The router marks it unhealthy within seconds; every
request completes or ends with a clear error (none hangs, none silently vanishes); later
requests go to the survivor."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from cluster_fixture import serving

from tandem.cluster.config import parse_cluster_config
from tandem.cluster.launch.local_backend import LocalBackend
from tandem.cluster.router.app import build_router

pytestmark = pytest.mark.slow
MAX_TOKENS = 600


async def one(client: httpx.AsyncClient, url: str, i: int, started: list) -> tuple[str, int, str]:
    """(outcome, chunks received, error text): ok only with every token and [DONE]."""
    body = {
        "model": "tiny",
        "prompt": [i + 1, 2, 3, 4],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    chunks, error = 0, ""
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return "error", 0, (await r.aread()).decode()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]["message"]
                continue
            chunks += 1
            if chunks == 1:
                started.append(i)
    if error:
        return "error", chunks, error
    return ("ok" if chunks == MAX_TOKENS else "vanished"), chunks, ""


# The router must see a killed instance as unhealthy, by its next state poll (0.3 s apart here,
# a refused connection marks it at once). How soon is a figure, not a bound: on two loaded cores
# the router's thread waited 3.6 s once; the limit is only there to end the wait.
DETECT_WITHIN_S = 10.0


def test_kill_instance_under_load(tiny_model_dirs, tmp_path):
    cfg = parse_cluster_config(
        {
            "models": [
                {
                    "name": "tiny",
                    "model": tiny_model_dirs["llama"],
                    "instances": 2,
                    "engine": {"dtype": "float32", "kv_cache_memory": 8 << 20},
                }
            ],
            "router": {"poll_interval_s": 0.3},
            "log_dir": str(tmp_path),
        }
    )
    backend = LocalBackend(cfg)
    instances = backend.start(timeout=300)
    try:
        app = build_router(cfg, instances)
        with serving(app) as (url, _):
            router = app.state.router

            async def run():
                started: list[int] = []
                async with httpx.AsyncClient(timeout=httpx.Timeout(60)) as c:
                    tasks = [
                        asyncio.create_task(asyncio.wait_for(one(c, url, i, started), 90))
                        for i in range(12)
                    ]
                    while len(started) < 12 and not all(t.done() for t in tasks):
                        await asyncio.sleep(0.02)
                    victim = max(router.pool.instances.values(), key=lambda i: i.inflight)
                    os.kill(backend.procs[victim.id].pid, signal.SIGKILL)
                    killed = time.monotonic()
                    while (
                        router.pool.instances[victim.id].state.healthy
                        and time.monotonic() - killed < DETECT_WITHIN_S
                    ):
                        await asyncio.sleep(0.05)
                    detect = time.monotonic() - killed
                    results = await asyncio.gather(*tasks, return_exceptions=True)
                    # On a loaded machine a 1 s state poll of the survivor can time out too: the
                    # router marks it unhealthy until its next poll answers. Wait for that poll.
                    survivor = next(i for i in router.pool.instances.values() if i.id != victim.id)
                    while not survivor.state.healthy and time.monotonic() - killed < 30:
                        await asyncio.sleep(0.05)
                    after = await asyncio.gather(
                        *(asyncio.wait_for(one(c, url, 100 + i, []), 90) for i in range(4))
                    )
                return victim, detect, results, after

            victim, detect, results, after = asyncio.run(run())
            assert detect < DETECT_WITHIN_S, (
                f"still healthy {detect:.1f}s after its process was killed"
            )
            assert not [r for r in results if isinstance(r, BaseException)], (
                results
            )  # no hang, no crash
            outcomes = [r[0] for r in results]
            assert "vanished" not in outcomes
            errors = [r[2] for r in results if r[0] == "error"]
            assert outcomes.count("ok") + len(errors) == 12 and outcomes.count("ok") >= 1
            assert all(victim.id in e and "mid-stream" in e for e in errors), errors
            assert [a[0] for a in after] == ["ok"] * 4
            state = httpx.get(url + "/cluster/state", timeout=30).json()
            assert not state[victim.id]["healthy"]
            print(
                f"killed {victim.id}: unhealthy after {detect:.2f}s; {outcomes.count('ok')} ok, "
                f"{len(errors)} clear errors"
            )
    finally:
        backend.stop()
