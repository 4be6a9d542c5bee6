"""Clusters for tests: instances (tiny engines, each with its own KV pool) and the router, all
served by uvicorn on loopback from background threads of the test process."""

from __future__ import annotations

import shutil
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from server_fixture import serving

from tandem.cluster.config import parse_cluster_config
from tandem.cluster.launch.instances import external_instances
from tandem.cluster.router.app import build_router
from tandem.config import EngineConfig
from tandem.engine.async_llm import AsyncLLM
from tandem.models.loader.model_files import load_tokenizer
from tandem.server.api_server import ServerConfig, build_app


@contextmanager
def tiny_instance(
    model_dir: str, name: str = "tiny", role: str = "colocated", elastic: bool = False, **engine
):
    opts = dict(model=model_dir, dtype="float32", kv_cache_memory=1 << 22, num_threads=1) | engine
    llm = AsyncLLM(EngineConfig.from_kwargs(**opts), in_process=True)
    try:
        with serving(build_app(llm, ServerConfig(model_name=name, role=role, elastic=elastic))) as (
            url,
            srv,
        ):
            yield url, llm, srv
    finally:
        llm.shutdown()


@contextmanager
def router_for(groups: list[dict], router: dict | None = None):
    """A router over instances given by URL: groups are cluster.yaml `models` entries with `urls`.
    Yields (router url, Router)."""
    cfg = parse_cluster_config(
        {"models": groups, "router": {"poll_interval_s": 0.2, **(router or {})}}
    )
    app = build_router(cfg, external_instances(cfg))
    with serving(app) as (url, _):
        yield url, app.state.router


@contextmanager
def tiny_cluster(
    model_dir: str, n: int = 3, router: dict | None = None, roles: list[str] | None = None, **engine
):
    """n tiny instances of model `tiny` behind a router.
    Yields (router url, Router, [(url, llm, server)])."""
    with ExitStack() as stack:
        roles = roles or ["colocated"] * n
        insts = [stack.enter_context(tiny_instance(model_dir, role=r, **engine)) for r in roles]
        group = {"name": "tiny", "model": model_dir, "urls": [u for u, _, _ in insts]}
        url, r = stack.enter_context(router_for([group], router))
        yield url, r, insts


@contextmanager
def launched_cluster(doc: dict, timeout: float = 120.0):
    """A cluster.yaml document launched as `tandem cluster up` does (local processes or Ray
    actors, the KV transfer group when configured) behind an in-process router. Yields
    (router url, Router)."""
    from tandem.cluster.launch.kv_group import join_kv_group
    from tandem.cluster.launch.launcher import make_backend

    cfg = parse_cluster_config({"router": {"poll_interval_s": 0.2}, **doc})
    backend = make_backend(cfg)
    instances = backend.start(timeout)
    try:
        store = join_kv_group(cfg, instances, backend.rendezvous_host())
        app = build_router(cfg, instances)
        with serving(app) as (url, _):
            yield url, app.state.router
        del store
    finally:
        backend.stop()


def with_word_tokenizer(model_dir: str, dst: Path) -> str:
    """A copy of a tiny checkpoint with a tokenizer whose every id decodes to its own word
    (`<id>`): equal texts then mean equal token ids, over the HTTP API."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, PreTrainedTokenizerFast

    shutil.copytree(model_dir, dst)
    vocab = {f"<{i}>": i for i in range(AutoConfig.from_pretrained(model_dir).vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(dst)
    load_tokenizer(
        dst
    )  # AutoTokenizer picks the class once: servers started on dst load it directly
    return str(dst)


def wait_for(cond, timeout: float = 5.0) -> bool:
    """Poll `cond` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False
