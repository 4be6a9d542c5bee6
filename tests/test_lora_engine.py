"""Greedy tokens with LoRA adapters equal transformers + peft's PeftModel (fp32) on tiny random
Llama / Qwen2 / Gemma 3 models: each adapter alone, three adapters and the base in one batch,
under chunked prefill, prefix hits, preemption, and more adapters than max_loras."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, token_ids
from lora_fixture import ATTENTION, make_adapter, peft_greedy

from tandem import LLM, LoRARequest, SamplingParams
from tandem.executor.kv_quant import kv_bytes_per_token
from tandem.models.config import ModelConfig
from tandem.models.loader.model_files import load_config

KINDS = ["llama", "qwen2", "gemma3"]
MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def cases(tiny_model_dirs, tmp_path_factory):
    """Per kind: the base's folder, three adapters (None: the base) and their references for
    eight prompts (each adapter and the base run every prompt)."""
    out = {}
    for kind in KINDS:
        base, root = tiny_model_dirs[kind], tmp_path_factory.mktemp(f"lora-{kind}")
        adapters = [
            make_adapter(base, root / "a", 1, r=8),
            make_adapter(base, root / "b", 2, r=16, targets=ATTENTION, rslora=True),
            make_adapter(base, root / "c", 3, r=4, targets=["q_proj", "v_proj", "down_proj"]),
            None,
        ]
        shared = random_prompts(5, 1, 24, 24)[0]
        prompts = random_prompts(4, 6, 3, 40) + [shared + p for p in random_prompts(6, 2, 2, 6)]
        refs = [peft_greedy(base, a, prompts, MAX_NEW) for a in adapters]
        out[kind] = (base, adapters, prompts, refs)
    return out


def _loras(adapters) -> list[LoRARequest | None]:
    return [None if a is None else LoRARequest(f"l{i}", i + 1, a) for i, a in enumerate(adapters)]


def _llm(base: str, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 1 << 22)
    kw.setdefault("dtype", "float32")
    return LLM(base, enable_lora=True, **kw)


def _mixed(llm: LLM, adapters, prompts, refs) -> None:
    """Every prompt under an adapter (cycling through the three and the base), in one batch."""
    loras = _loras(adapters)
    pick = [i % len(loras) for i in range(len(prompts))]
    outs = llm.generate(prompts, GREEDY, lora_request=[loras[k] for k in pick])
    assert token_ids(outs) == [refs[k][i] for i, k in enumerate(pick)]


@pytest.mark.parametrize("kind", KINDS)
def test_each_adapter_alone_matches_peft(kind, cases):
    base, adapters, prompts, refs = cases[kind]
    llm = _llm(base)
    for lora, ref in zip(_loras(adapters), refs):
        outs = llm.generate(prompts, GREEDY, lora_request=lora)
        assert token_ids(outs) == ref
    assert refs[0] != refs[3]  # the adapters change the output


@pytest.mark.parametrize("kind", KINDS)
def test_three_adapters_and_base_in_one_batch(kind, cases):
    _mixed(_llm(cases[kind][0]), *cases[kind][1:])


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_under_chunked_prefill(kind, cases):
    _mixed(_llm(cases[kind][0], max_num_batched_tokens=16, block_size=8), *cases[kind][1:])


def test_more_adapters_than_max_loras(cases):
    """Three adapters and the base with two slots: each step runs in parts, slots evicted."""
    llm = _llm(cases["qwen2"][0], max_loras=2)
    _mixed(llm, *cases["qwen2"][1:])
    assert sum(llm.engine.core.executor.lora.evictions.values()) > 0


def test_prefix_hits_are_kept_per_adapter(cases):
    """The shared prefix is reused under the same adapter, never across adapters."""
    base, adapters, prompts, refs = cases["llama"]
    llm = _llm(base, block_size=8)
    loras = _loras(adapters)
    for k in (0, 1, 3):  # the same prefixed prompts under each in turn: no hits across
        outs = llm.generate(prompts[6:7], GREEDY, lora_request=loras[k])
        assert outs[0].outputs[0].token_ids == refs[k][6]
    stats = llm.engine.core.kv_manager.stats
    assert stats.hits == 0
    outs = llm.generate(prompts[7:], GREEDY, lora_request=loras[1])
    assert stats.hits >= 24 // 8 * 8  # the adapter's own prefix is served
    assert outs[0].outputs[0].token_ids == refs[1][7]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_mixed_under_preemption(mode, cases):
    base, adapters, prompts, refs = cases["qwen2"]
    per_token = kv_bytes_per_token(ModelConfig.from_hf(load_config(base)), torch.float32)
    llm = _llm(
        base,
        block_size=4,
        kv_cache_memory=per_token * 4 * 20,
        enable_prefix_caching=False,
        preemption_mode=mode,
    )
    _mixed(llm, adapters, prompts, refs)
    assert llm.engine.core.scheduler.preemptions_by_mode[mode] > 0
    kv = llm.engine.core.kv_manager
    assert kv.num_free_blocks == llm.engine.core.executor.num_kv_blocks


@pytest.mark.parametrize(
    "weights", [{"quantization": "int8"}, {"quantization": "int4"}, {"dtype": "bfloat16"}]
)
def test_adapters_over_a_quantised_base(weights, cases, tmp_path):
    """Over int8 / int4 / bf16 weights: an adapter whose B is zero (peft's own init) leaves the
    base's tokens as they are, in a batch mixed with a real adapter that changes them."""
    import peft
    import transformers as tf

    base, adapters, prompts, _ = cases["qwen2"]
    model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft.get_peft_model(
        model, peft.LoraConfig(r=8, target_modules=["q_proj", "up_proj"])
    ).save_pretrained(tmp_path / "zero")
    llm = _llm(base, **weights)
    plain = token_ids(llm.generate(prompts, GREEDY))
    zero, real = LoRARequest("zero", 1, str(tmp_path / "zero")), LoRARequest("a", 2, adapters[0])
    picks = [zero, real] * (len(prompts) // 2)
    outs = token_ids(llm.generate(prompts, GREEDY, lora_request=picks))
    assert outs[0::2] == plain[0::2]
    assert outs[1::2] != plain[1::2]
