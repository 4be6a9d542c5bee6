"""The router's and the embedding instance's route modules alone: an app holding just that
router and a fake state, through a TestClient (no instances, no model)."""

from __future__ import annotations

import base64
import threading
from types import SimpleNamespace

import numpy as np
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tandem.cluster.launch import embedding_routes
from tandem.cluster.router import routes as router_routes
from tandem.server.errors import add_error_handlers


class FakeEmbedder:
    dim = 2
    tokenizer = SimpleNamespace(vocab_size=10)

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def embed(self, inputs):
        return np.array([[0.6, 0.8]] * len(inputs), dtype=np.float32), sum(len(x) for x in inputs)


def embedding_client() -> TestClient:
    app = FastAPI()
    app.include_router(embedding_routes.api)
    add_error_handlers(app)
    app.state.embedding = embedding_routes.EmbeddingState(FakeEmbedder(), "emb")
    return TestClient(app)


def test_embedding_routes_alone():
    client = embedding_client()
    out = client.post("/v1/embeddings", json={"model": "emb", "input": ["ab", "cde"]}).json()
    assert [d["embedding"] for d in out["data"]] == [[0.6000000238418579, 0.800000011920929]] * 2
    assert out["usage"]["prompt_tokens"] == 5
    b64 = client.post("/v1/embeddings", json={"input": [1, 2], "encoding_format": "base64"}).json()
    assert np.allclose(
        np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), "<f4"), [0.6, 0.8]
    )
    for body, status, words in [
        ({"input": ""}, 400, "must not be empty"),
        ({"input": [11]}, 400, "vocabulary"),
        ({"input": "x", "dimensions": 3}, 400, "dimensions"),
        ({"input": "x", "model": "other"}, 404, "does not exist"),
        ({"input": "x", "truncate": 4}, 400, "unsupported field `truncate`"),
    ]:
        r = client.post("/v1/embeddings", json=body)
        assert r.status_code == status and words in r.json()["error"]["message"], r.text
    state = client.get("/tandem/state").json()
    assert state["role"] == "embedding" and state["num_waiting"] == state["num_running"] == 0
    assert "tandem:embedding_requests_total" in client.get("/metrics").text


class FakeRouter:
    groups = {
        "tiny": SimpleNamespace(name="tiny", kind="chat"),
        "emb": SimpleNamespace(name="emb", kind="embedding"),
    }

    def __init__(self, healthy: bool) -> None:
        self.healthy, self.routed = healthy, []

    async def route(self, request, kind):
        self.routed.append((request.url.path, kind))
        return {"routed": kind}

    def health(self):
        return self.healthy, {"status": "ok" if self.healthy else "degraded"}

    def cluster_state(self):
        return {"i0": {"healthy": self.healthy}}

    def model_cards(self):
        return [{"id": g.name, "object": "model", "kind": g.kind} for g in self.groups.values()]


def router_client(healthy: bool = True) -> tuple[TestClient, FakeRouter]:
    app = FastAPI()
    app.include_router(router_routes.api)
    app.state.router = fake = FakeRouter(healthy)
    return TestClient(app), fake


def test_router_routes_alone():
    client, fake = router_client()
    assert client.post("/v1/chat/completions", json={}).json() == {"routed": "chat"}
    assert client.post("/v1/completions", json={}).json() == {"routed": "chat"}
    assert client.post("/v1/embeddings", json={}).json() == {"routed": "embedding"}
    assert fake.routed == [
        ("/v1/chat/completions", "chat"),
        ("/v1/completions", "chat"),
        ("/v1/embeddings", "embedding"),
    ]
    assert {(m["id"], m["kind"]) for m in client.get("/v1/models").json()["data"]} == {
        ("tiny", "chat"),
        ("emb", "embedding"),
    }
    assert client.get("/health").status_code == 200 and client.get("/cluster/state").json() == {
        "i0": {"healthy": True}
    }
    assert router_client(healthy=False)[0].get("/health").status_code == 503
