"""The real default model (SmolLM2-135M): greedy tokens equal transformers' generate (fp32),
batched with chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

import pytest
from conftest import hf_greedy

from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow
MAX_NEW = 24


@pytest.fixture(scope="module")
def smollm():
    from tandem.models.loader.model_files import resolve_model

    path = str(resolve_model("smollm2-135m"))
    llm = LLM(path, dtype="float32", quantization="fp32", kv_cache_memory=64 << 20)
    tok = llm.tokenizer
    system = "You are a concise assistant. Answer in one short sentence."
    chats = [
        tok.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": q}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for q in (
            "What is the capital of France?",
            "Name a primary colour.",
            "Why is the sky blue?",
        )
    ]
    prompts = [
        tok.encode(p) for p in chats + ["The three laws of thermodynamics are", "def fibonacci(n):"]
    ]
    return llm, path, prompts, hf_greedy(path, prompts, MAX_NEW)


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def test_batched_greedy_matches_hf(smollm):
    llm, _, prompts, ref = smollm
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref
    # The shared system prompt is served from the prefix cache on a second pass.
    again = llm.generate(prompts[:3], GREEDY)
    assert [o.outputs[0].token_ids for o in again] == ref[:3]
    assert llm.engine.core.kv_manager.stats.hits > 0


def test_chunked_and_preempted_greedy_matches_hf(smollm):
    _, path, prompts, ref = smollm
    import torch

    from tandem.executor.kv_quant import kv_bytes_per_token
    from tandem.models.config import ModelConfig
    from tandem.models.loader.model_files import load_config

    per_block = kv_bytes_per_token(ModelConfig.from_hf(load_config(path)), torch.float32) * 16
    llm = LLM(
        path,
        dtype="float32",
        quantization="fp32",
        kv_cache_memory=per_block * 12,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    )
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_chat_text_is_sensible(smollm):
    llm = smollm[0]
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=20),
    )[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")
