"""Adapters served by name through a live `tandem serve` with the official openai client:
`--lora-modules` at start, load and unload at run time (behind the API key, paths confined to
the adapter folder, each refusal in words), /v1/models with each adapter's parent, and an
unload under load that loses no request and leaves no KV behind."""

from __future__ import annotations

import re
import shutil
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from lora_fixture import ATTENTION, make_adapter, peft_greedy, write_gguf_lora
from server_fixture import running_server

from tandem.config import EngineConfig
from tandem.server.api_server import ServerConfig

KEY = "sesame"
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [300, 12, 99, 7, 250, 1, 3]]
MAX_NEW = 8


@pytest.fixture(scope="module")
def setup(tiny_model_dirs, tmp_path_factory):
    base, root = tiny_model_dirs["qwen2"], tmp_path_factory.mktemp("adapters")
    a = make_adapter(base, root / "a", 1)
    b = make_adapter(base, root / "b", 2, r=16, targets=ATTENTION)
    make_adapter(base, root / "big", 3, r=32)
    refs = {name: peft_greedy(base, path, PROMPTS, MAX_NEW) for name, path in (("a", a), ("b", b))}
    refs["tiny"] = peft_greedy(base, None, PROMPTS, MAX_NEW)
    engine = EngineConfig.from_kwargs(
        model=base,
        dtype="float32",
        kv_cache_memory=1 << 22,
        block_size=4,
        enable_lora=True,
        lora_modules=[f"a={a}"],
        lora_dir=str(root),
    )
    with running_server(engine, ServerConfig(model_name="tiny", api_key=KEY)) as (url, llm):
        yield url, llm, refs


def _tokens(client: openai.OpenAI, model: str, prompt: list[int]) -> list[int]:
    out = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_NEW,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]


def _post(url: str, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + path, json=body, headers=headers, timeout=60)


def test_adapters_by_name(setup):
    url, _, refs = setup
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY)
    cards = {m.id: m for m in client.models.list().data}
    assert cards["a"].parent == "tiny" and cards["a"].root.endswith("/a")
    for model in ("a", "tiny"):
        assert [_tokens(client, model, p) for p in PROMPTS] == refs[model]
    with pytest.raises(openai.NotFoundError):
        _tokens(client, "b", PROMPTS[0])
    r = _post(url, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "b"})
    assert r.status_code == 200, r.text
    assert "b" in {m.id for m in client.models.list().data}
    assert [_tokens(client, "b", p) for p in PROMPTS] == refs["b"]
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for key, least in (("requests", 3), ("tokens", 3 * MAX_NEW), ("loads", 1)):
        m = re.search(rf'^tandem:lora_{key}_total{{.*lora_name="b".*}} ([0-9.e+]+)$', metrics, re.M)
        assert m and float(m.group(1)) >= least, key


def test_gguf_adapter_loads_at_run_time(setup):
    """A GGUF LoRA file (llama.cpp's converter's layout) of adapter b loads by its path and
    serves b's tokens."""
    url, _, refs = setup
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY)
    root = Path(next(m.root for m in client.models.list().data if m.id == "a")).parent
    write_gguf_lora(str(root / "b"), root / "b.gguf", "qwen2")
    r = _post(url, "/v1/load_lora_adapter", {"lora_name": "bg", "lora_path": "b.gguf"})
    assert r.status_code == 200, r.text
    assert [_tokens(client, "bg", p) for p in PROMPTS] == refs["b"]


def test_refusals_in_words(setup, tmp_path):
    url = setup[0]
    load = "/v1/load_lora_adapter"
    assert _post(url, load, {"lora_name": "x", "lora_path": "a"}, key=None).status_code == 401
    r = _post(url, load, {"lora_name": "x", "lora_path": "../x"})
    assert r.status_code == 400 and "outside the adapter folder" in r.text
    r = _post(url, load, {"lora_name": "x", "lora_path": "big"})
    assert r.status_code == 400 and "over max_lora_rank" in r.text
    r = _post(url, load, {"lora_name": "x", "lora_path": "missing"})
    assert r.status_code == 400 and "has no adapter_config.json" in r.text
    r = _post(url, load, {"lora_name": "a", "lora_path": "a"})
    assert r.status_code == 400 and "already loaded" in r.text
    r = _post(url, "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert r.status_code == 404


def test_unload_under_load(setup):
    """Requests running with an adapter when it is unloaded finish with it; its name is refused
    from then on, and every KV block comes back."""
    url, llm, refs = setup
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY)
    assert _post(url, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": "a"}).is_success
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = _tokens(client, "c", PROMPTS[i % len(PROMPTS)])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while llm.num_in_flight < len(threads) and time.monotonic() < deadline:
        time.sleep(0.001)  # every request admitted under the name before it goes
    assert _post(url, "/v1/unload_lora_adapter", {"lora_name": "c"}).is_success
    for t in threads:
        t.join(60)
    assert results == {i: refs["a"][i % len(PROMPTS)] for i in range(6)}
    with pytest.raises(openai.NotFoundError):
        _tokens(client, "c", PROMPTS[0])
    kv = llm.engine_core.kv_manager
    assert kv.num_free_blocks == llm.engine_core.executor.num_kv_blocks


def test_runtime_loading_is_off_without_a_folder(tiny_model_dirs, tmp_path):
    shutil.copytree(tiny_model_dirs["qwen2"], tmp_path / "m")
    engine = EngineConfig.from_kwargs(model=str(tmp_path / "m"), enable_lora=True)
    with running_server(engine, ServerConfig(model_name="tiny")) as (url, _):
        r = _post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "a"})
        assert r.status_code == 404 and "off" in r.text


def test_router_routes_by_adapter(tiny_model_dirs, setup, tmp_path):
    """Through the router: an adapter goes only to the instance that serves it (the other
    would answer 404); the base to either; /v1/models lists the adapter under its group."""
    from cluster_fixture import router_for, tiny_instance

    refs = setup[2]
    base = tiny_model_dirs["qwen2"]
    adapter = make_adapter(base, tmp_path / "a", 1)
    with (
        tiny_instance(base, enable_lora=True, lora_modules=[f"a={adapter}"]) as (with_a, _, _),
        tiny_instance(base) as (plain, _, _),
        router_for([{"name": "tiny", "model": base, "urls": [with_a, plain]}]) as (url, router),
    ):
        deadline = time.monotonic() + 30
        while not any(i.loras for i in router.pool.instances.values()):
            assert time.monotonic() < deadline, "the router never saw the adapter"
            time.sleep(0.05)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        assert {"id": "a", "parent": "tiny"}.items() <= next(
            m.model_dump() for m in client.models.list().data if m.id == "a"
        ).items()
        assert [_tokens(client, "a", p) for p in PROMPTS * 2] == refs["a"] * 2
        assert [_tokens(client, "tiny", p) for p in PROMPTS] == refs["tiny"]
