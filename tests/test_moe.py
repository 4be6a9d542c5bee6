"""Mixture-of-experts models (Qwen3-MoE, Mixtral, Qwen2-MoE) from tiny random Hugging Face
folders: fp32 greedy tokens equal transformers' alone, batched, under chunked prefill, on prefix
hits, through preemption (swap and recompute), with speculation (n-gram, self-draft), across P/D
and in deterministic mode; a step runs only the experts its tokens chose, each once; quantised
variants keep the routers float."""

from __future__ import annotations

import pytest
import torch
from conftest import MOE_KINDS as KINDS
from conftest import hf_greedy, random_prompts, tiny_moe_config, token_ids, write_tiny_model

from tandem import LLM, SamplingParams
from tandem.executor.kv_quant import kv_bytes_per_token
from tandem.kernels import cpu_invariant_gemm, cpu_paged_decode
from tandem.models.config import ModelConfig
from tandem.models.layers.activation import Gate
from tandem.models.layers.fused_moe import FusedMoE
from tandem.models.layers.linear import Linear
from tandem.models.loader.model_files import load_config

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def references(moe_dirs):
    prompts = random_prompts(1, 5, 3, 60)
    shared = random_prompts(2, 1, 40, 40)[0]
    prefixed = [shared + p for p in random_prompts(3, 3, 2, 9)]
    return {
        kind: (prompts, hf_greedy(d, prompts, MAX_NEW), prefixed, hf_greedy(d, prefixed, MAX_NEW))
        for kind, d in moe_dirs.items()
    }


def _llm(path: str, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("kv_cache_memory", 1 << 22)
    return LLM(path, **kw)


def test_config_reads_the_sparse_layers_and_the_routing(moe_dirs) -> None:
    qwen3, mixtral, qwen2 = (ModelConfig.from_hf(load_config(moe_dirs[k])).moe for k in KINDS)
    assert qwen3.sparse_layers == (True, False, True) and qwen3.renormalize
    assert (qwen3.num_experts, qwen3.top_k, qwen3.shared_expert_size) == (8, 2, 0)
    assert mixtral.sparse_layers == (True,) * 3 and mixtral.renormalize
    assert (mixtral.num_experts, mixtral.intermediate_size) == (4, 64)
    assert not qwen2.renormalize and qwen2.shared_expert_size == 96


@pytest.mark.parametrize("kind", KINDS)
def test_alone_and_batched_match_hf(kind, moe_dirs, references) -> None:
    prompts, ref, _, _ = references[kind]
    llm = _llm(moe_dirs[kind])
    assert token_ids(llm.generate(prompts[:1], GREEDY)) == ref[:1]
    assert token_ids(llm.generate(prompts, GREEDY)) == ref


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_matches_hf(kind, moe_dirs, references) -> None:
    prompts, ref, _, _ = references[kind]
    llm = _llm(moe_dirs[kind], max_num_batched_tokens=16, block_size=8)
    assert token_ids(llm.generate(prompts, GREEDY)) == ref


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_cache_hits_match_hf(kind, moe_dirs, references) -> None:
    _, _, prefixed, ref = references[kind]
    llm = _llm(moe_dirs[kind], block_size=8)
    first = llm.generate(prefixed[:1], GREEDY)
    rest = llm.generate(prefixed[1:], GREEDY)
    assert llm.engine.core.kv_manager.stats.hits >= 2 * 40 // 8 * 8
    assert token_ids(first + rest) == ref


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("kind", KINDS)
def test_preemption_matches_hf(kind, mode, moe_dirs, references) -> None:
    prompts, ref, _, _ = references[kind]
    per_token = kv_bytes_per_token(ModelConfig.from_hf(load_config(moe_dirs[kind])), torch.float32)
    llm = _llm(
        moe_dirs[kind],
        block_size=4,
        kv_cache_memory=per_token * 4 * 20,  # the longest request alone (~70 tokens), not all
        enable_prefix_caching=False,
        preemption_mode=mode,
    )
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.core.scheduler.preemptions_by_mode[mode] > 0
    assert token_ids(outs) == ref


SPECULATION = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    "self-int4": {
        "method": "draft",
        "model": "self:int4",
        "num_speculative_tokens": 3,
        "adaptive": False,
    },
}


@pytest.mark.parametrize("proposer", SPECULATION)
@pytest.mark.parametrize("kind", KINDS)
def test_speculation_matches_hf(kind, proposer, moe_dirs, references) -> None:
    """The target verifies several tokens a request in one step: routed per token as ever."""
    prompts, ref, _, _ = references[kind]
    copying = prompts[1][:20] * 2  # the n-gram proposer drafts from its own prompt
    llm = _llm(moe_dirs[kind], speculative_config=SPECULATION[proposer])
    outs = llm.generate([*prompts, copying], GREEDY)
    assert token_ids(outs) == ref + hf_greedy(moe_dirs[kind], [copying], MAX_NEW)
    assert llm.engine.core.scheduler.spec_stats.num_draft_tokens > 0


@pytest.mark.parametrize("kind", KINDS)
def test_pd_through_shm_matches_hf(kind, moe_dirs) -> None:
    """P/D: one engine prefills, the KV moves through shared memory, another decodes on."""
    from test_kv_transfer import BS, MAX_NEW, decode, prefill

    from tandem.executor.kv_transfer import ShmTransport

    prompts = random_prompts(7, 4, 5, 40)
    ref = hf_greedy(moe_dirs[kind], prompts, MAX_NEW)
    prefill_side, decode_side = (_llm(moe_dirs[kind], block_size=BS).engine for _ in range(2))
    conn = ShmTransport()
    for i, prompt in enumerate(prompts):
        first, payload = prefill(prefill_side, prompt, f"p{i}")
        conn.send(f"t{i}", payload)
        assert decode(decode_side, prompt, first, conn, f"t{i}") == ref[i]
    assert decode_side.core.kv_manager.stats.hits > 0


@pytest.mark.skipif(
    cpu_invariant_gemm() is None or cpu_paged_decode(64) is None,
    reason="no C++ toolchain for the native kernels",
)
@pytest.mark.parametrize("precision", [{}, {"quantization": "int4"}], ids=["fp32", "int4"])
def test_deterministic_mode_gives_each_request_its_single_request_run(precision, tmp_path) -> None:
    """The routers and experts run on the batch-invariant GEMM (int4: the integer kernel), and
    each token sums its experts in expert order whatever shares the step. head_dim 64: the
    paged kernel's."""
    config = tiny_moe_config("qwen3_moe")
    config.head_dim = 64
    path = write_tiny_model(config, tmp_path)
    llm = _llm(path, deterministic=True, max_num_batched_tokens=17, **precision)
    prompts = random_prompts(6, 5, 3, 40)
    batched = token_ids(llm.generate(prompts, GREEDY))
    assert batched == [token_ids(llm.generate([p], GREEDY))[0] for p in prompts]


def test_a_step_runs_each_chosen_expert_once_and_no_other() -> None:
    torch.manual_seed(0)
    block = FusedMoE(16, 6, top_k=2, intermediate_size=8, renormalize=True, act=Gate.SILU)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.5)
    calls: dict[int, int] = {}
    for i, expert in enumerate(block.experts):
        expert.register_forward_pre_hook(
            lambda m, args, i=i: calls.__setitem__(i, calls.get(i, 0) + 1)
        )
    x = torch.randn(3, 16)
    ids = torch.topk(block.gate(x), 2, dim=-1).indices
    out = block(x)
    assert calls == dict.fromkeys(sorted(set(ids.flatten().tolist())), 1)
    # each row: its two experts' outputs, weighted by the renormalised softmax
    probs = torch.softmax(block.gate(x), -1)
    for row in range(3):
        w = probs[row, ids[row]] / probs[row, ids[row]].sum()
        outs = [block.experts[int(e)](x[row : row + 1], Gate.SILU)[0] for e in ids[row]]
        expected = w[0] * outs[0] + w[1] * outs[1]
        torch.testing.assert_close(out[row], expected)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantised_variants_keep_the_routers_float(weights, moe_dirs) -> None:
    llm = _llm(moe_dirs["qwen2_moe"], quantization=weights)
    model = llm.engine.core.executor.variants.models[weights]
    block = model.layers[0].mlp
    assert type(block.gate) is Linear and type(block.shared_expert_gate) is Linear
    assert type(block.experts[0].gate_up_proj) is not Linear
    assert len(llm.generate(random_prompts(4, 2, 5, 20), GREEDY)[1].outputs[0].token_ids) == MAX_NEW
