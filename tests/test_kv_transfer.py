"""KV transfer for P/D disaggregation: a prompt prefilled on one engine, its KV moved through a
transport, and decoding continued on another engine gives the very tokens of a plain run;
no block leaks on any path (finish, abort before admission, a failed import)."""

from __future__ import annotations

import socket
import threading
from collections import Counter

import pytest
import torch
import torch.multiprocessing as mp
from conftest import random_prompts, token_ids
from hypothesis import given, settings
from hypothesis import strategies as st
from test_block_pool import check_pool, make_req

from tandem import LLM, SamplingParams
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.kv_connector.pd import KVPoolFullError, PDConnector
from tandem.executor.kv_quant import kv_bytes_per_token, row_len
from tandem.executor.kv_transfer import KVPayload, ShmTransport
from tandem.models.config import ModelConfig
from tandem.models.loader.model_files import load_config

BS = 8
MAX_NEW = 8
LENGTHS = (5, 13, 16, 29, 40)  # under a block, ragged, exactly two blocks, ragged, exactly five


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _prompts(seed: int = 0) -> list[list[int]]:
    """One prompt of each of LENGTHS; another `seed`, other tokens."""
    return [random_prompts(seed * 100 + i, 1, n, n)[0] for i, n in enumerate(LENGTHS)]


def _llm(path: str, **kw) -> LLM:
    return LLM(path, **{"dtype": "float32", "kv_cache_memory": 1 << 22, "block_size": BS, **kw})


def _run(engine, prompt: list[int], params: SamplingParams, request_id: str) -> list[int]:
    engine.add_request(prompt, params, request_id=request_id)
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out.outputs[0].token_ids


def prefill(engine, prompt: list[int], request_id: str) -> tuple[int, KVPayload]:
    """Prefill role: the prompt and its first token, then the KV of its whole blocks."""
    first = _run(engine, prompt, greedy(1), request_id)[0]
    return first, engine.core.kv_handoff.export(prompt)


def decode(engine, prompt: list[int], first: int, transport, transfer_id: str) -> list[int]:
    """Decode role: reserve, receive layer by layer into the reserved blocks, continue."""
    handoff = engine.core.kv_handoff
    res = handoff.reserve(prompt)
    payload, _ = transport.recv(transfer_id, timeout=30, on_layer=handoff.writer(res))
    engine.add_request(prompt + [first], greedy(MAX_NEW - 1), request_id=transfer_id)
    handoff.commit(res, payload, transfer_id)
    assert engine.core.kv_connector.pins[transfer_id].num_blocks == len(prompt) // BS
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
    return [first] + tokens


def assert_no_blocks_held(engine) -> None:
    assert not engine.core.kv_connector.pins
    assert engine.core.kv_manager.num_free_blocks == engine.core.executor.num_kv_blocks


@pytest.fixture(scope="module")
def llama(tiny_model_dirs) -> str:
    return tiny_model_dirs["llama"]


def plain_run(path: str) -> list[list[int]]:
    return token_ids(_llm(path).generate(_prompts(), greedy(MAX_NEW)))


@pytest.fixture(scope="module")
def reference(llama) -> list[list[int]]:
    return plain_run(llama)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize(
    "kind", ["llama", "gemma3"]
)  # Gemma 3: sliding windows shorter than most prompts
def test_pd_through_shm_matches_plain_run(kind, async_scheduling, tiny_model_dirs):
    model = tiny_model_dirs[kind]
    reference = plain_run(model)
    a, b = (_llm(model, async_scheduling=async_scheduling).engine for _ in range(2))
    conn = ShmTransport()
    for i, prompt in enumerate(_prompts()):
        first, payload = prefill(a, prompt, f"p{i}")
        assert payload.num_blocks == len(prompt) // BS
        conn.send(f"t{i}", payload)
        assert decode(b, prompt, first, conn, f"t{i}") == reference[i]
    # The decode side computed only the tails: every whole prompt block came over.
    assert b.core.kv_manager.stats.hits == sum(n // BS * BS for n in LENGTHS)
    assert_no_blocks_held(a)
    assert_no_blocks_held(b)


def test_transferred_kv_is_what_decode_reads(llama, reference):
    """Control: zeroed KV in transit changes the output, so equality above is not vacuous."""
    a, b, conn = _llm(llama).engine, _llm(llama).engine, ShmTransport()
    prompt = _prompts()[-1]
    first, payload = prefill(a, prompt, "p")
    payload.kv.zero_()
    conn.send("t", payload)
    assert decode(b, prompt, first, conn, "t") != reference[-1]


def _block_bytes(model_dir: str) -> int:
    return kv_bytes_per_token(ModelConfig.from_hf(load_config(model_dir)), torch.float32) * BS


def test_payload_bytes(llama):
    a, conn = _llm(llama).engine, ShmTransport()
    per_block = _block_bytes(llama)
    _, payload = prefill(a, _prompts()[-1], "p")
    assert payload.num_bytes == payload.num_blocks * per_block == 5 * per_block
    assert payload.layer_bytes * payload.num_layers == payload.num_bytes
    sent = conn.send("t", payload)
    got, received = conn.recv("t", timeout=5)
    assert sent.num_bytes == received.num_bytes == payload.num_bytes
    assert len(received.layer_seconds) == payload.num_layers and received.seconds > 0
    assert torch.equal(got.kv, payload.kv.cpu()) and got.token_ids == payload.token_ids


def test_int8_payload_carries_the_scales(llama):
    """An int8 cache's blocks travel as they are, each row's scales in it: the payload's bytes
    are what the pool counts per block, and the rows arrive bit for bit."""
    a, conn = _llm(llama, kv_cache_dtype="int8").engine, ShmTransport()
    cfg = ModelConfig.from_hf(load_config(llama))
    _, payload = prefill(a, _prompts()[-1], "p")
    assert payload.kv.dtype == torch.int8
    assert payload.kv.shape[-1] == row_len(cfg.head_dim, torch.int8)
    assert payload.num_bytes == 5 * BS * kv_bytes_per_token(cfg, torch.int8)
    conn.send("t", payload)
    got, _ = conn.recv("t", timeout=5)
    assert torch.equal(got.kv, payload.kv.cpu())


def test_bf16_and_empty_payloads_round_trip():
    conn = ShmTransport()
    kv = torch.randn(3, 2, 2, 4, 2, 8).to(torch.bfloat16)
    for tid, payload in (
        ("bf16", KVPayload(list(range(8)), 4, kv)),
        ("empty", KVPayload([], 4, kv[:, :, :0].contiguous())),
    ):
        conn.send(tid, payload)
        got, stats = conn.recv(tid, timeout=5)
        assert got.kv.dtype == torch.bfloat16 and torch.equal(got.kv, payload.kv)
        assert stats.num_bytes == payload.num_bytes


def test_abort_before_admission_releases_the_pin(llama):
    a, b, conn = _llm(llama).engine, _llm(llama).engine, ShmTransport()
    prompt = _prompts()[-1]
    first, payload = prefill(a, prompt, "p")
    res = b.core.kv_handoff.reserve(prompt)
    conn.send("t", payload)
    got, _ = conn.recv("t", timeout=5, on_layer=b.core.kv_handoff.writer(res))
    b.add_request(prompt + [first], greedy(4), request_id="t")
    b.core.kv_handoff.commit(res, got, "t")
    total = b.core.executor.num_kv_blocks
    assert b.core.kv_manager.num_free_blocks == total - 5  # pinned: not evictable before admission
    b.abort_request("t")
    assert_no_blocks_held(b)
    assert b.core.kv_manager.pool.num_cached_blocks == 5  # still cached, evictable, for a later hit


def test_reserve_fails_whole_when_the_pool_is_short(llama):
    a, conn = _llm(llama).engine, ShmTransport()
    b = _llm(llama, kv_cache_memory=6 * _block_bytes(llama), max_model_len=40).engine
    assert b.core.executor.num_kv_blocks == 6
    long, short = _prompts()[-1], _prompts()[2]
    held = b.core.kv_handoff.reserve(long)  # 5 of 6 blocks
    with pytest.raises(KVPoolFullError):
        b.core.kv_handoff.reserve(short)  # needs 2
    assert b.core.kv_manager.num_free_blocks == 1  # the failed reservation took nothing
    _, payload = prefill(a, short, "p")  # a payload for other tokens is refused, and released
    with pytest.raises(ValueError):
        b.core.kv_handoff.commit(held, payload, "x")
    assert_no_blocks_held(b)
    conn.send("t", payload)
    got, _ = conn.recv("t", timeout=5)
    res = b.core.kv_handoff.reserve(short)
    b.core.kv_handoff.write(res, got)
    b.core.kv_handoff.release(res)  # e.g. the request was refused after the transfer
    assert_no_blocks_held(b)


def test_blocks_cached_on_the_decode_side_are_pinned_not_rewritten(llama, reference):
    a, b, conn = _llm(llama).engine, _llm(llama).engine, ShmTransport()
    prompt = _prompts()[-1]
    _run(b, prompt[:20] + [1, 2, 3], greedy(1), "warm")  # blocks 0 and 1 of the prompt cached on b
    (cached,), _ = b.core.kv_connector.cached_prefix(prompt)
    own = b.core.executor.read_kv_blocks([blk.block_id for blk in cached])
    assert own.shape[2] == 2
    first, payload = prefill(a, prompt, "p")
    payload.kv[:, :, :2] = (
        0  # had decode overwritten its own blocks 0 and 1, the output would show it
    )
    conn.send("t", payload)
    assert decode(b, prompt, first, conn, "t") == reference[-1]
    kept = [blk.block_id for blk in b.core.kv_connector.cached_prefix(prompt)[0][0][:2]]
    assert torch.equal(own, b.core.executor.read_kv_blocks(kept))
    assert_no_blocks_held(b)


def test_shorter_payload_than_reserved(llama, reference):
    """The prefill side cached only 2 of the 5 blocks: the rest is given back and recomputed."""
    a, b, conn = _llm(llama, max_prefix_tokens=16).engine, _llm(llama).engine, ShmTransport()
    prompt = _prompts()[-1]
    first, payload = prefill(a, prompt, "p")
    assert payload.num_blocks == 2
    conn.send("t", payload)
    res = b.core.kv_handoff.reserve(prompt)
    got, _ = conn.recv("t", timeout=5, on_layer=b.core.kv_handoff.writer(res))
    b.add_request(prompt + [first], greedy(MAX_NEW - 1), request_id="t")
    b.core.kv_handoff.commit(res, got, "t")
    assert b.core.kv_connector.pins["t"].num_blocks == 2
    tokens = []
    while b.has_unfinished_requests():
        for out in b.step():
            tokens = out.outputs[0].token_ids
    assert [first] + tokens == reference[-1]
    assert_no_blocks_held(b)


def test_writes_wait_for_steps_in_flight(llama):
    """Async scheduling: a reserved block may have been freed by a request whose last step
    still runs and writes it, so the import writes only once the steps in flight are done."""
    from concurrent.futures import Future

    from tandem.executor.kv_transfer import KVHandoff

    a, b = _llm(llama).engine, _llm(llama).engine
    step = Future()
    handoff = KVHandoff(b.core.kv_connector, b.core.executor, lambda: [step])
    prompt = _prompts()[-1]
    _, payload = prefill(a, prompt, "p")
    res = handoff.reserve(prompt)
    write = handoff.writer(res)
    done = threading.Event()
    threading.Thread(target=lambda: (write(0, payload.kv[0]), done.set()), daemon=True).start()
    assert not done.wait(0.2)
    step.set_result(None)
    assert done.wait(5)
    handoff.release(res)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["reserve", "commit", "release", "admit", "free"]),
            st.integers(0, 3),
            st.integers(0, 4),
        ),
        max_size=40,
    )
)
def test_reservations_and_requests_never_leak(ops):
    """Any mix of reservations (pinned hits, fresh blocks, short commits, releases) and plain
    requests sharing prefixes keeps every block free or held exactly by its holders."""
    kv = KVCacheManager(10, 4)
    pd = PDConnector(kv.coordinator, {})
    base = list(range(16))
    prompts = [base, base[:8] + [90] * 8, base[:4] + [91] * 9, [92] * 13]
    reservations, committed, requests = [], [], []
    for i, (op, k, n) in enumerate(ops):
        if op == "reserve" and (res := pd.reserve(prompts[k])) is not None:
            reservations.append(res)
        elif op == "commit" and reservations:
            res = reservations.pop(k % len(reservations))
            pd.commit(res, n)
            committed.append(res)
        elif op == "release" and (reservations or committed):
            pool = reservations if reservations and (k % 2 or not committed) else committed
            pd.release(pool.pop(k % len(pool)))
        elif op == "admit":
            req = make_req(f"r{i}", prompts[k])
            blocks, hit = kv.get_computed_blocks(req)
            if kv.allocate_slots(req, req.num_tokens - hit, blocks) is not None:
                req.num_computed_tokens = req.num_tokens
                kv.cache_blocks(req)
                requests.append(req)
        elif op == "free" and requests:
            kv.free(requests.pop(k % len(requests)))
        check_pool(kv.pool)
        holders = Counter(b.block_id for r in reservations + committed for b in r.blocks[0])
        held = kv.coordinator.managers[0].req_to_blocks
        holders.update(b.block_id for r in requests for b in held[r.request_id])
        assert all(b.ref_cnt == holders[b.block_id] for b in kv.pool.blocks)
    for res in reservations + committed:
        pd.release(res)
    for req in requests:
        kv.free(req)
    check_pool(kv.pool)
    assert kv.num_free_blocks == 10


def test_shm_timeout_and_no_file_left(tmp_path):
    conn = ShmTransport(tmp_path)
    with pytest.raises(TimeoutError):
        conn.recv("missing", timeout=0.05)
    conn.send("t", KVPayload([], 4, torch.zeros(1, 2, 0, 4, 1, 2)))
    conn.recv(
        "t", timeout=1
    )  # a receiver that drops the payload (a refused decode leg) still takes it
    assert list(tmp_path.iterdir()) == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pd_worker(
    rank: int, model_dir: str, prompts: list[list[int]], port: int, firsts, results
) -> None:
    """Rank 0 prefills, rank 1 decodes; even prompts move over gloo, odd ones over shm."""
    from tandem.executor.kv_transfer import TorchDistTransport, init_kv_group

    init_kv_group(rank, 2, f"tcp://127.0.0.1:{port}", backend="gloo")
    transports = (TorchDistTransport(peer=1 - rank), ShmTransport())
    engine = _llm(model_dir).engine
    for i, prompt in enumerate(prompts):
        conn = transports[i % 2]
        if rank == 0:
            first, payload = prefill(engine, prompt, f"p{i}")
            firsts.put(first)  # what the router carries to the decode side
            conn.send(f"t{i}", payload)
        else:
            results.put(decode(engine, prompt, firsts.get(timeout=60), conn, f"t{i}"))
    assert_no_blocks_held(engine)
    torch.distributed.destroy_process_group()


@pytest.mark.slow  # two spawned processes: 7-12 s here
def test_pd_across_processes_over_gloo_and_shm(llama, reference):
    ctx = mp.get_context("spawn")
    firsts, results = ctx.Queue(), ctx.Queue()
    mp.spawn(_pd_worker, args=(llama, _prompts(), _free_port(), firsts, results), nprocs=2)
    assert [results.get(timeout=5) for _ in LENGTHS] == reference
