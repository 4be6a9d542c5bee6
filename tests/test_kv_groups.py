"""KV groups: sliding-window layers' blocks behind the window go back to the pool while the
full-attention layers keep theirs; accounting, prefix hits, swap and freeing stay exact."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.core.kv_cache_coordinator import cdiv
from tandem.core.kv_cache_manager import KVCacheManager
from tandem.core.kv_groups import kv_groups
from tandem.core.request import Request
from tandem.core.sampling_params import SamplingParams

BS = 4


def make_req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64))


def test_gemma3_270m_layers_make_one_full_and_five_sliding_groups_of_three():
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    groups = kv_groups(windows)
    assert groups.layers_per_group == 3 and groups.windows == (512,) * 5 + (None,)
    assert sorted(groups.layer_slots) == [
        (k, j) for k in range(6) for j in range(3)
    ]  # one slot each
    assert all(
        groups.windows[k] == windows[layer] for layer, (k, _) in enumerate(groups.layer_slots)
    )


def test_one_kind_of_attention_is_the_plain_layout():
    assert kv_groups([None] * 4).windows == (None,) and kv_groups([None] * 4).layers_per_group == 4
    assert kv_groups([8, 8]).windows == (8,)
    assert kv_groups([8, None, 8, 8]).windows == (8, 8, 8, None)  # gcd 1: a group per layer


def _check(kv: KVCacheManager, reqs: dict[str, Request]) -> None:
    """Every group holds a block per logical block of a request; a sliding group's blocks behind
    the window of its next query are the null block once freed, every other block a real one."""
    managers, null = kv.coordinator.managers, kv.coordinator.null_block
    for rid, first in managers[0].req_to_blocks.items():
        req = reqs[rid]
        assert len(first) >= cdiv(req.num_computed_tokens, BS)
        for m in managers:
            assert len(m.req_to_blocks[rid]) == len(first)
            for i, b in enumerate(m.req_to_blocks[rid]):
                if i >= m.live_from(req.num_computed_tokens):
                    assert b is not null and b.ref_cnt >= 1
    owned = {
        b.block_id
        for m in managers
        for blocks in m.req_to_blocks.values()
        for b in blocks
        if b is not null
    }
    assert len(owned) + kv.num_free_blocks <= kv.num_blocks


@settings(max_examples=60, deadline=None)
@given(
    windows=st.sampled_from([(6, 6, None), (5, None), (9,), (None, 7, 7, None)]),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    chunk=st.integers(1, 16),
    swap_at=st.integers(0, 30),
    shared=st.integers(0, 20),
)
def test_allocation_frees_behind_windows_and_accounts_exactly(
    windows, lengths, chunk, swap_at, shared
):
    """Requests prefill in chunks and decode; each allocation takes exactly `blocks_needed`
    from the pool, the blocks behind a window are freed, a swap round trip keeps the layout,
    prefix hits hold every block a query after them reads, and nothing leaks."""
    kv = KVCacheManager(200, block_size=BS, num_host_blocks=200, group_windows=windows)
    reqs: dict[str, Request] = {}
    common = list(range(1000, 1000 + shared))
    for n, length in enumerate(lengths):
        req = make_req(f"r{n}", common + [n * 100 + t for t in range(length)])
        reqs[req.request_id] = req
        hits, num_hit = kv.get_computed_blocks(req)
        for m, blocks in zip(kv.coordinator.managers, hits):  # every hit a query at num_hit reads
            for i, b in enumerate(blocks):  # is the cached chunk
                if i >= m.live_from(num_hit):
                    assert b.token_ids == tuple(req.all_token_ids[i * BS : (i + 1) * BS])
        first = min(chunk, req.num_tokens - num_hit)
        free = kv.num_free_blocks
        need = kv.blocks_needed(req, first, hits)
        assert kv.allocate_slots(req, first, hits) is not None
        assert free - kv.num_free_blocks == need
        req.num_computed_tokens = num_hit + first
        kv.cache_blocks(req)
        steps, decodes = 0, 0
        while decodes < 8:  # the rest of the prompt, then 8 decodes
            if req.num_computed_tokens >= req.num_tokens:
                req.all_token_ids.append(7)
                decodes += 1
            if steps == swap_at:
                pairs = kv.host_tier.swap_out(req)
                assert pairs is not None and len({d for d, _ in pairs}) == len(pairs)
                back = kv.host_tier.swap_in(req, 0)
                assert back is not None and len(back[0]) == len(pairs)
                kv.host_tier.release_pending_host_blocks()
            step = min(chunk, req.num_tokens - req.num_computed_tokens)
            free = kv.num_free_blocks
            need = kv.blocks_needed(req, step)
            assert kv.allocate_slots(req, step) is not None
            assert free - kv.num_free_blocks == need
            req.num_computed_tokens += step
            kv.cache_blocks(req)
            _check(kv, reqs)
            steps += 1
    for req in reqs.values():
        kv.free(req)
    assert kv.num_free_blocks == kv.num_blocks
    assert not any(m.req_to_blocks for m in kv.coordinator.managers)


def test_a_long_request_holds_the_window_not_the_context():
    """A 400-token request on a model of 1 full and 5 sliding groups (window 32): the sliding
    groups hold about window / block_size blocks each, the full group all of them."""
    kv = KVCacheManager(1000, block_size=16, group_windows=(32,) * 5 + (None,))
    req = make_req("a", list(range(400)))
    for _ in range(0, 400, 16):
        assert kv.allocate_slots(req, 16) is not None
        req.num_computed_tokens += 16
    kv.allocate_slots(req, 1)
    held = kv.num_blocks - kv.num_free_blocks
    assert (
        held == 26 + 5 * 3
    )  # the full group's 26 blocks; 3 per sliding group (window 32 + the next token)
    assert held < 6 * 26 / 3


def test_gemma3_serves_a_request_the_plain_layout_could_not_hold(tiny_model_dirs):
    """Tiny Gemma 3 (2 sliding layers, window 12, and 1 full): a pool of 30 one-layer blocks of
    4 tokens is 10 blocks of all three layers, 40 tokens in the plain layout. Prefilled in chunks
    of 16, the sliding layers hold only their window, so a 50-token request fits, with
    transformers' greedy tokens, and the blocks behind the window are back in the pool while it
    decodes."""
    import torch
    from conftest import hf_greedy

    from tandem import LLM, SamplingParams
    from tandem.executor.kv_quant import kv_bytes_per_token
    from tandem.models.config import ModelConfig
    from tandem.models.loader.model_files import load_config

    path = tiny_model_dirs["gemma3"]
    per_token = kv_bytes_per_token(ModelConfig.from_hf(load_config(path)), torch.float32)
    llm = LLM(
        path,
        dtype="float32",
        block_size=BS,
        kv_cache_memory=per_token * BS * 10,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    core = llm.engine.core
    assert core.kv_manager.group_windows == (12, 12, None) and core.executor.num_kv_blocks == 30
    assert core.max_model_len >= 50 > 40
    prompt = [(7 * i) % 500 + 3 for i in range(40)]
    llm.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    held, out = [], None
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            out = o
        held.append(core.kv_manager.num_blocks - core.kv_manager.num_free_blocks)
    assert out.outputs[0].token_ids == hf_greedy(path, [prompt], 10)[0]
    # while decoding past position 40: 13 blocks of the full layer, at most 4 per sliding layer
    assert max(held[-3:]) <= 13 + 2 * 4 < 3 * 13
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


def test_bench_kv_reports_the_window_held_against_full_attention(tiny_model_dirs, tmp_path):
    """`tandem bench kv` on tiny Gemma 3: 60 + 4 tokens in blocks of 16 hold the full layer's 4
    blocks and 1-2 per sliding layer while decoding, against 4 per layer with full attention."""
    import argparse
    import json

    from tandem.bench.kv import main

    out = tmp_path / "kv.json"
    report = main(
        argparse.Namespace(
            model=tiny_model_dirs["gemma3"],
            prompt_len=60,
            output_len=4,
            max_num_batched_tokens=16,
            quantization="auto",
            dtype="float32",
            seed=0,
            json_path=str(out),
        )
    )
    assert (
        report["kv_groups"] == ["window 12", "window 12", "full"]
        and report["layers_per_group"] == 1
    )
    assert 6 / 12 <= report["last_step_vs_full"] <= 8 / 12 and report["peak_vs_full"] <= 1.0
    assert json.loads(out.read_text()) == report
