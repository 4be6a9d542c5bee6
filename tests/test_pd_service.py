"""The engine-core side of P/D (`PDService`), driven by hand against plain engines as the
engine-core process drives it: utilities between steps, `on_add` right after the add. The
greedy tokens of prefill on one engine + decode on another equal a plain run, and no block is
held after any path (finish, refused add, failed receive, unclaimed KV, a migration)."""

from __future__ import annotations

import time
import uuid

import pytest
from test_kv_transfer import (
    BS,
    MAX_NEW,
    _block_bytes,
    _llm,
    _prompts,
    _run,
    assert_no_blocks_held,
    greedy,
    llama,
    reference,
)

from tandem.core.kv_connector.pd import KVPoolFullError
from tandem.engine import pd_service
from tandem.engine.pd_service import PDService
from tandem.executor.kv_transfer import ShmTransport


def _tid(name: str) -> str:
    """A transfer id no other run on this host uses (shm names are host-wide)."""
    return f"{name}-{uuid.uuid4().hex[:12]}"


def _finish(engine, request_id: str) -> list[int]:
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                tokens = out.outputs[0].token_ids
    return tokens


def _decode(b, svc: PDService, prompt: list[int], first: int, tid: str, rid: str) -> list[int]:
    got = svc.receive_kv(prompt, tid, None).result(timeout=30)
    assert got["kv_blocks"] == len(prompt) // BS and "error" not in got
    b.add_request(prompt + [first], greedy(MAX_NEW - 1), request_id=rid)
    svc.on_add(rid, {"transfer_id": tid}, True)
    assert b.core.kv_connector.pins[rid].num_blocks == len(prompt) // BS
    assert svc.num_held_blocks() == 0
    return [first] + _finish(b, rid)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prefill_send_then_receive_and_add_match_a_plain_run(llama, reference, async_scheduling):
    a, b = (_llm(llama, async_scheduling=async_scheduling).engine for _ in range(2))
    pa, pb = PDService(a.core), PDService(b.core)
    tids = [_tid(f"t{i}") for i in range(len(_prompts()))]
    for i, prompt in enumerate(_prompts()):
        first = _run(a, prompt, greedy(1), f"p{i}")[0]
        assert pa.send_kv(prompt, tids[i], None) == len(prompt) // BS
        assert _decode(b, pb, prompt, first, tids[i], f"d{i}") == reference[i]
        sent = pa.kv_sent(tids[i]).result(timeout=30)
        assert sent["kv_bytes"] == len(prompt) // BS * _block_bytes(llama) and "error" not in sent
    assert b.core.kv_manager.stats.hits == sum(
        len(p) // BS * BS for p in _prompts()
    )  # every whole block came over
    with pytest.raises(ValueError, match="no KV send"):
        pa.kv_sent(tids[0])  # an outcome is read once
    assert_no_blocks_held(a)
    assert_no_blocks_held(b)


def test_a_refused_add_or_an_unknown_transfer_holds_nothing(llama):
    a, b = _llm(llama).engine, _llm(llama).engine
    pa, pb = PDService(a.core), PDService(b.core)
    prompt, t = _prompts()[-1], _tid("t")
    _run(a, prompt, greedy(1), "p")
    pa.send_kv(prompt, t, None)
    assert pb.receive_kv(prompt, t, None).result(timeout=30)["kv_blocks"] == 5
    assert pb.num_held_blocks() == 5
    pb.on_add("d", {"transfer_id": t}, False)  # the engine refused the decode request
    pb.on_add(
        "d2", {"transfer_id": "never-received"}, True
    )  # logged; the request recomputes its prompt
    pb.release_kv(t)  # a no-op now
    assert pb.num_held_blocks() == 0
    assert_no_blocks_held(b)


def test_a_failed_receive_is_reported_and_released(llama, monkeypatch):
    b = _llm(llama).engine
    pb = PDService(b.core)
    monkeypatch.setattr(pd_service, "RECV_TIMEOUT_S", 0.05)
    missing = _tid("missing")
    got = pb.receive_kv(_prompts()[-1], missing, None).result(timeout=30)
    assert got["error"].startswith("TimeoutError")
    assert pb.num_held_blocks() == 5  # held until the route gives them back
    pb.release_kv(missing)
    assert_no_blocks_held(b)


def test_unclaimed_kv_is_released_after_a_while(llama, monkeypatch):
    a, b = _llm(llama).engine, _llm(llama).engine
    pa, pb = PDService(a.core), PDService(b.core)
    prompt, t = _prompts()[-1], _tid("t")
    _run(a, prompt, greedy(1), "p")
    pa.send_kv(prompt, t, None)
    pb.receive_kv(prompt, t, None).result(timeout=30)
    pb.on_add("x", {"transfer_id": "other"}, True)
    assert pb.num_held_blocks() == 5  # still within CLAIM_S
    monkeypatch.setattr(pd_service, "CLAIM_S", 0.0)
    pb.on_add("x", {"transfer_id": "other"}, True)  # the next engine-thread call sweeps it
    assert_no_blocks_held(b)


def test_pool_short_and_bad_peer_fail_whole_and_a_drain_takes_the_transfer(llama):
    a = _llm(llama).engine
    b = _llm(llama, kv_cache_memory=4 * _block_bytes(llama), max_model_len=30).engine
    pa, pb = PDService(a.core), PDService(b.core)
    prompt, t = _prompts()[-1], _tid("t")  # 5 blocks: more than b has
    _run(a, prompt, greedy(1), "p")
    pa.send_kv(prompt, t, None)
    with pytest.raises(KVPoolFullError):
        pb.receive_kv(prompt, t, None)
    pb.drain_kv(t, None)
    assert pa.kv_sent(t).result(timeout=30)["kv_bytes"] > 0
    deadline = time.monotonic() + 10
    while ShmTransport().path(t).exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not ShmTransport().path(t).exists()  # the drain took it off the link
    for call in (
        lambda: pa.send_kv(prompt, "u", 3),
        lambda: pb.receive_kv(prompt, "u", 3),
        lambda: pb.check_kv_peer(3),
        lambda: pa.migrate_out("p", prompt, "u", 3),
    ):
        with pytest.raises(ValueError, match="in no group"):
            call()
    assert_no_blocks_held(b)
    assert_no_blocks_held(a)


def test_migrate_out_moves_a_decoding_request(llama, reference):
    """A request stopped mid-decode on one engine continues on another from the tokens its
    client has, with the KV of their whole blocks: the tokens of an unmoved run."""
    a, b = _llm(llama).engine, _llm(llama).engine
    pa, pb = PDService(a.core), PDService(b.core)
    prompt = _prompts()[-1]  # 40 tokens: 5 blocks, then the generated tokens start block 6
    a.add_request(prompt, greedy(MAX_NEW), request_id="r")
    generated: list[int] = []
    while len(generated) < 4:
        for out in a.step():
            generated = list(out.outputs[0].token_ids)
    tokens = prompt + generated[:4]
    m = _tid("m")
    assert pa.migrate_out("r", tokens, m, None) == len(tokens) // BS
    assert "r" not in a.core.unfinished_request_ids()  # aborted by the same call
    got = pb.receive_kv(tokens[:-1], m, None).result(timeout=30)
    assert got["kv_blocks"] == 5 and "error" not in got
    b.add_request(tokens, greedy(MAX_NEW - 4), request_id="r")
    pb.on_add("r", {"transfer_id": m}, True)
    assert generated[:4] + _finish(b, "r") == reference[-1]
    assert pa.kv_sent(m).result(timeout=30)["kv_bytes"] > 0
    assert_no_blocks_held(a)
    assert_no_blocks_held(b)


def test_every_utility_message_has_one_handler_whose_parameters_are_its_fields():
    """The core calls a handler with the message's fields as keyword arguments: a field renamed
    on one side only would fail at the first call, so it fails here."""
    import inspect

    from tandem.engine.core import EngineCore
    from tandem.engine.core_messages import (
        UTILITY_MESSAGES,
        AddLoRA,
        CompileGrammar,
        GetSchedulerStats,
        RemoveLoRA,
    )

    handlers = {
        CompileGrammar: EngineCore.compile_grammar,
        GetSchedulerStats: EngineCore.scheduler_stats,
        AddLoRA: EngineCore.add_lora,
        RemoveLoRA: EngineCore.remove_lora,
        **PDService.__new__(PDService).utilities(),
    }
    assert set(handlers) == set(UTILITY_MESSAGES)
    for kind, handler in handlers.items():
        params = [p for p in inspect.signature(handler).parameters if p != "self"]
        assert params == list(kind.__struct_fields__), kind.__name__
