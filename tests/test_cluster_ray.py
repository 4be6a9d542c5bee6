"""The Ray backend on a one-node Ray head started (and stopped) by the test: instances are Ray
actors placed by resources; the router is the same and only sees their URLs. P/D between Ray
actors over torch_dist: `test_cluster_pd.py::test_pd_over_torch_dist_equals_colocated[ray]`."""

from __future__ import annotations

import httpx
import psutil
import pytest
from cluster_fixture import serving, wait_for

from tandem.cluster.config import parse_cluster_config
from tandem.cluster.router.app import build_router

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")


def test_ray_instances_behind_the_router(tiny_model_dirs):
    from tandem.cluster.launch.ray_backend import RayBackend

    cfg = parse_cluster_config(
        {
            "backend": "ray",
            "ray": {"address": None},
            "models": [
                {
                    "name": "tiny",
                    "model": tiny_model_dirs["llama"],
                    "instances": 2,
                    "engine": {"dtype": "float32", "kv_cache_memory": 4 << 20},
                    "resources": {"num_cpus": 1, "num_gpus": 0},
                    "restart": True,
                }
            ],
            "router": {"poll_interval_s": 0.2},
        }
    )
    backend = RayBackend(cfg)
    before = set(psutil.Process().children(recursive=True))
    try:
        instances = backend.start(timeout=300)
        assert len(instances) == 2 and all(i.url.startswith("http://127.0.0.1:") for i in instances)
        app = build_router(cfg, instances)
        with serving(app) as (url, _):
            seen = set()
            for k in range(4):
                r = httpx.post(
                    url + "/v1/completions",
                    timeout=60,
                    json={
                        "model": "tiny",
                        "prompt": [k + 1] * 20,
                        "max_tokens": 4,
                        "ignore_eos": True,
                    },
                )
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
                seen.add(r.headers["x-tandem-instance"])
            assert seen <= {"tiny-0", "tiny-1"}
            backend.kill("tiny-0")  # an actor lost: the router routes around it
            for k in range(3):
                r = httpx.post(
                    url + "/v1/completions",
                    timeout=60,
                    json={
                        "model": "tiny",
                        "prompt": [9, 9, k],
                        "max_tokens": 2,
                        "ignore_eos": True,
                    },
                )
                assert r.status_code == 200 and r.headers["x-tandem-instance"] == "tiny-1"
            old_url = instances[0].url
            backend.check()  # what `tandem cluster up` runs every 0.5 s: the dead actor comes back
            assert "tiny-0" not in backend.left_out and instances[0].url != old_url
            assert wait_for(
                lambda: httpx.get(url + "/cluster/state").json()["tiny-0"]["healthy"], 10
            )
        started = set(psutil.Process().children(recursive=True)) - before
        actors = [p for p in started if "InstanceServer" in " ".join(p.cmdline())]
        assert len(actors) == 2, [p.cmdline() for p in started]  # tiny-1 and the restarted tiny-0
    finally:
        backend.stop()
    assert not ray.is_initialized()
    _, alive = psutil.wait_procs(list(started), timeout=15)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], [
        p.cmdline() for p in alive
    ]
