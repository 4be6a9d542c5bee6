"""`tandem bench quality`'s perplexity is the model's: on tiny random models (Gemma 3 with its KV
groups among them) it equals transformers' on the same tokens and weights, fp32."""

from __future__ import annotations

import math

import pytest
import torch

from tandem import LLM
from tandem.bench.perplexity import perplexity
from tandem.models.loader.hf_reference import hf_model


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_perplexity_equals_transformers(kind, tiny_model_dirs):
    path = tiny_model_dirs[kind]
    tokens = [(13 * i + 5) % 500 + 3 for i in range(45)]
    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 22, block_size=4)
    runner = llm.engine.core.executor
    ours = perplexity(runner, runner.variants.default, tokens, window=20)
    model, nll, count = hf_model(path, torch.float32), 0.0, 0
    for start in range(0, len(tokens) - 1, 20):
        chunk = torch.tensor([tokens[start : start + 20]])
        with torch.inference_mode():
            logp = torch.log_softmax(model(chunk).logits[0, :-1].float(), -1)
        nll -= logp.gather(1, chunk[0, 1:, None]).sum().item()
        count += chunk.shape[1] - 1
    assert ours == pytest.approx(math.exp(nll / count), rel=1e-4)
