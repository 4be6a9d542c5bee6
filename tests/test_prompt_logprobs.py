"""Prompt logprobs (vLLM's `prompt_logprobs`; `echo` with `logprobs` at the server): each prompt
token's logprob given the tokens before it equals Hugging Face's teacher-forced log-softmax in
fp32, whether the prompt runs in one step or in chunks, after a prefix-cache hit would have
skipped it, and with logit_bias on the sampled tokens (which must not touch them)."""

from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams

PROMPTS = [
    [5, 9, 301, 44, 17, 250, 3, 3, 98, 411, 7, 120, 66, 2, 480, 31, 9, 5, 77, 200],
    [12, 13, 14],
    [400],
]


def hf_logprobs(model_dir: str, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].log_softmax(-1)


@pytest.mark.parametrize("chunk", [2048, 8])
def test_prompt_logprobs_equal_teacher_forced(tiny_model_dirs, chunk):
    path = tiny_model_dirs["llama"]
    llm = LLM(
        path, dtype="float32", kv_cache_memory=1 << 22, max_num_batched_tokens=chunk, block_size=8
    )
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1))  # cached now: a hit would skip them
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, logit_bias={0: 50.0})
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        ref = hf_logprobs(path, prompt)
        assert out.outputs[0].token_ids == [0, 0]  # the bias decided the sampled tokens
        entries = out.prompt_logprobs
        assert len(entries) == len(prompt) - 1
        for p, entry in enumerate(entries):
            (token, lp), top = entry[0], entry[1:]
            assert token == prompt[p + 1]
            assert lp == pytest.approx(ref[p, token].item(), abs=1e-4)
            want = ref[p].topk(3)
            assert [t for t, _ in top] == want.indices.tolist()
            assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-4)


def test_no_prompt_logprobs_unless_asked(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", kv_cache_memory=1 << 22)
    assert llm.generate([PROMPTS[1]], SamplingParams(max_tokens=1))[0].prompt_logprobs is None


def test_n_sequences_compute_prompt_logprobs_once(tiny_model_dirs, monkeypatch):
    from tandem.executor import prompt_logprobs

    llm = LLM(tiny_model_dirs["llama"], dtype="float32", kv_cache_memory=1 << 22, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    want = llm.generate([PROMPTS[0]], params)[0].prompt_logprobs
    rows = []
    real = prompt_logprobs._entries
    monkeypatch.setattr(
        prompt_logprobs,
        "_entries",
        lambda lps, targets, k: rows.extend(targets) or real(lps, targets, k),
    )
    out = llm.generate([PROMPTS[0]], SamplingParams(n=2, max_tokens=2, prompt_logprobs=2))[0]
    assert len(out.outputs) == 2
    assert len(rows) == len(PROMPTS[0]) - 1  # one sequence's prompt, not one per sequence
    assert out.prompt_logprobs == want
