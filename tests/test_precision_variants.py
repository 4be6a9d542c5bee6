"""Several precision variants of one model in one engine: each request gets the tokens of its
variant run alone; KV is never shared across variants; choice order, fallback and bad names."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, token_ids

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
MIXED = dict(quantization="bf16", precision_classes={"standard": "int8", "background": "int4"})


def _llm(path: str, **kw) -> LLM:
    # bf16 activations for every variant, as in the mixed engine (an AVX2 CPU's default is fp32)
    return LLM(path, kv_cache_memory=1 << 22, **{"dtype": "bfloat16", **kw})


def test_mixed_engine_gives_each_request_its_variant_alone_tokens(tiny_model_dirs):
    path, prompts = tiny_model_dirs["llama"], random_prompts(5, 6, 3, 40)
    precisions = ["bf16", "int8", "int4", "int4", "bf16", "int8"]
    alone = {}
    for p in ("bf16", "int8", "int4"):
        mine = [q for q, pp in zip(prompts, precisions) if pp == p]
        outs = _llm(path, quantization=p).generate(mine, GREEDY)
        alone[p] = token_ids(outs)
    mixed = _llm(path, **MIXED)
    assert set(mixed.engine.core.executor.variants.models) == {"bf16", "int8", "int4"}
    ids = [mixed.engine.add_request(q, GREEDY, precision=p) for q, p in zip(prompts, precisions)]
    done = {}
    while mixed.engine.has_unfinished_requests():
        for out in mixed.engine.step():
            if out.finished:
                done[out.request_id] = out
    for p in ("bf16", "int8", "int4"):
        got = [done[i].outputs[0].token_ids for i, pp in zip(ids, precisions) if pp == p]
        assert got == alone[p], p
        assert all(done[i].precision == p for i, pp in zip(ids, precisions) if pp == p)
    assert alone["bf16"] != alone["int4"]  # the variants really differ
    assert mixed.engine.precisions.requests_by_precision == {"bf16": 2, "int8": 2, "int4": 2}


def test_prefix_cache_is_per_variant(tiny_model_dirs):
    llm = _llm(tiny_model_dirs["llama"], **MIXED)
    prompt = random_prompts(9, 1, 3, 40)[0] * 3  # several whole blocks
    first = llm.engine.core.kv_manager.stats.hits
    llm.engine.add_request(prompt, GREEDY, precision="int8")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.engine.add_request(prompt, GREEDY, precision="int4")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.engine.core.kv_manager.stats.hits == first  # int4 did not reuse int8's KV
    llm.engine.add_request(prompt, GREEDY, precision="int4")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.engine.core.kv_manager.stats.hits > first  # but its own


def test_choice_order_field_then_class_then_default(tiny_model_dirs):
    llm = _llm(tiny_model_dirs["llama"], **MIXED)
    router = llm.engine.precisions
    assert router.choose(None, None) == "bf16"
    assert router.choose(None, 3) == "int4"  # class background
    assert router.choose("int8", 3) == "int8"  # the request's own choice wins
    assert router.choose(None, 1) == "bf16"  # interactive has no class entry: the default
    with pytest.raises(
        ValueError, match=r"precision 'fp32' is not served here; served: bf16, int8, int4"
    ):
        llm.engine.add_request([1, 2, 3], GREEDY, precision="fp32")
    assert not llm.engine.has_unfinished_requests()


def test_unbuildable_variant_falls_back_with_a_count(tmp_path, caplog):
    """int4 cannot be built for a model whose hidden size no group size divides: its requests go
    to the fallback, with a log line and a counted fallback."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=256,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=3,
        num_key_value_heads=1,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    llm = _llm(
        str(tmp_path),
        quantization="int8",
        precision_fallback="bf16",
        precision_classes={"background": "int4"},
    )
    assert "int4" in llm.engine.core.executor.variants.unavailable
    out = llm.generate([[1, 2, 3]], GREEDY)[0]  # no priority: the default
    assert out.precision == "int8"
    rid = llm.engine.add_request([1, 2, 3], GREEDY, priority=3)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.engine.precisions.fallbacks == {("int4", "bf16", "not_built"): 1}
    assert "precision int4 is unavailable" in caplog.text and rid
    with pytest.raises(ValueError, match="the fallback precision int4 cannot be built"):
        _llm(str(tmp_path), quantization="int8", precision_fallback="int4")
    with pytest.raises(ValueError, match="precision int4 cannot be built"):
        _llm(str(tmp_path), quantization="int4")


def test_bad_precision_names_fail_at_construction():
    with pytest.raises(ValueError, match="unknown precision 'int2'"):
        EngineConfig.from_kwargs(quantization="int2")
    with pytest.raises(ValueError, match="'urgent' is not a request class"):
        EngineConfig.from_kwargs(precision_classes={"urgent": "int8"})
