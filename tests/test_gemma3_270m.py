"""The real Gemma 3 270M (the Q4_K_M GGUF of `--model gemma3-270m`, dequantised): greedy tokens
equal transformers' Gemma3ForCausalLM (fp32) on the converted weights, batched, with prefix-cache
hits, chunked prefill, swap preemption and n-gram speculation; one prompt is longer than the
512-token sliding window, so the local layers' window is exercised, and their blocks behind it
are freed (KV groups)."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy

from tandem import LLM, SamplingParams
from tandem.executor.kv_quant import kv_bytes_per_token
from tandem.models.config import ModelConfig
from tandem.models.loader.model_files import load_config, resolve_model

pytestmark = pytest.mark.slow
MAX_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
_LONG = " ".join(
    f"Day {i}: the village baker sold {3 * i % 17 + 2} loaves and {i % 5 + 1} cakes."
    for i in range(40)
)


@pytest.fixture(scope="module")
def gemma():
    path = str(resolve_model("gemma3-270m"))
    llm = LLM(path, dtype="float32", quantization="fp32", kv_cache_memory=64 << 20)
    tok = llm.tokenizer
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n",
        _LONG + " On the next day, the baker",
    ]
    prompts = [tok(t).input_ids for t in texts]
    assert len(prompts[2]) > 512 and prompts[0][0] == tok.bos_token_id
    return llm, path, prompts, hf_greedy(path, prompts, MAX_NEW)


def test_batched_and_prefix_hits_match_hf(gemma):
    llm, _, prompts, ref = gemma
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == ref
    again = llm.generate(prompts[2:], GREEDY)  # the long prompt from the prefix cache
    assert [o.outputs[0].token_ids for o in again] == ref[2:]
    assert llm.engine.core.kv_manager.stats.hits > 0


def test_chunked_prefill_and_swap_match_hf(gemma):
    _, path, prompts, ref = gemma
    per_block = kv_bytes_per_token(ModelConfig.from_hf(load_config(path)), torch.float32) * 16
    # Room for the long request alone (45 blocks of 16 in the full layers; its local layers hold
    # their 512-token window plus a chunk, the blocks behind it freed), not for all three at once.
    llm = LLM(
        path,
        dtype="float32",
        quantization="fp32",
        kv_cache_memory=per_block * 40,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        preemption_mode="swap",
    )
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == ref
    assert llm.engine.core.scheduler.preemptions_by_mode["swap"] > 0


def test_ngram_speculation_matches_hf(gemma):
    _, path, prompts, ref = gemma
    llm = LLM(
        path,
        dtype="float32",
        quantization="fp32",
        kv_cache_memory=64 << 20,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    )
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == ref
    assert llm.engine.core.scheduler.spec_stats.num_draft_tokens > 0
