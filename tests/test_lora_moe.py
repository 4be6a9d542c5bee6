"""LoRA adapters over mixture-of-experts models (Qwen3-MoE, Mixtral, Qwen2-MoE): on the attention
projections of every layer, and on the MLP of a layer the model keeps dense (Qwen3-MoE's middle
one), fp32 greedy tokens equal transformers + peft's, mixed with the base in one batch. An
adapter of the experts, the shared expert or the router is refused in words.

PEFT on transformers 5 rewrites MLP targets of a Qwen3-MoE into the fused experts' parameters
(`target_parameters`), so it cannot adapt the dense layer's MLP by name; the references here turn
that rewrite off, which leaves PEFT's LoRA on the dense layer's nn.Linear projections."""

from __future__ import annotations

import pytest
from conftest import MOE_KINDS
from lora_fixture import ATTENTION, make_adapter, peft_greedy

from tandem import LLM, LoRARequest, SamplingParams
from tandem.models.config import ModelConfig
from tandem.models.loader.model_files import load_config
from tandem.models.lora.loader import load_adapter

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42], [300, 12, 99, 7, 250, 1, 3], [77] * 20]


def _no_moe_rewrite(m: pytest.MonkeyPatch) -> None:
    from peft.utils import transformers_weight_conversion

    m.setattr(
        transformers_weight_conversion, "convert_peft_config_for_transformers", lambda *a, **k: None
    )


@pytest.fixture(scope="module")
def cases(moe_dirs, tmp_path_factory):
    """Per kind: an attention adapter (and for Qwen3-MoE one of every projection, which adapts
    the dense layer's MLP too), the base, and their references."""
    out = {}
    with pytest.MonkeyPatch.context() as m:
        _no_moe_rewrite(m)
        for kind, base in moe_dirs.items():
            root = tmp_path_factory.mktemp(f"lora-{kind}")
            adapters = [make_adapter(base, root / "attn", 2, r=16, targets=ATTENTION), None]
            if kind == "qwen3_moe":
                adapters.append(make_adapter(base, root / "all", 1, r=8))
            out[kind] = adapters, [peft_greedy(base, a, PROMPTS, MAX_NEW) for a in adapters]
    return out


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_attention_and_dense_mlp_adapters_match_peft(kind, moe_dirs, cases):
    adapters, refs = cases[kind]
    llm = LLM(moe_dirs[kind], dtype="float32", kv_cache_memory=1 << 22, enable_lora=True)
    loras = [None if a is None else LoRARequest(f"l{i}", i + 1, a) for i, a in enumerate(adapters)]
    pick = [i % len(loras) for i in range(2 * len(PROMPTS))]
    prompts = PROMPTS * 2
    outs = llm.generate(prompts, GREEDY, lora_request=[loras[k] for k in pick])
    assert [o.outputs[0].token_ids for o in outs] == [
        refs[k][i % len(PROMPTS)] for i, k in enumerate(pick)
    ]
    assert all(r != refs[1] for r in refs[:1] + refs[2:])  # each adapter changes the output


def test_dense_layer_mlp_is_adapted(moe_dirs, cases):
    cfg = ModelConfig.from_hf(load_config(moe_dirs["qwen3_moe"]))
    adapter = load_adapter(cases["qwen3_moe"][0][2], cfg, max_rank=8)
    mlps = {n for n in adapter.modules if ".mlp." in n}
    assert mlps == {"layers.1.mlp.gate_up_proj", "layers.1.mlp.down_proj"}  # layer 1 is dense


def test_expert_adapters_refused_in_words(moe_dirs, tmp_path):
    """PEFT's own Qwen3-MoE adapter of every projection (its experts as target_parameters), and
    one of a Qwen2-MoE's shared expert."""
    qwen3 = make_adapter(moe_dirs["qwen3_moe"], tmp_path / "q3", 1)
    cfg = ModelConfig.from_hf(load_config(moe_dirs["qwen3_moe"]))
    with pytest.raises(ValueError, match="targets parameters: LoRA on a mixture-of-experts"):
        load_adapter(qwen3, cfg, max_rank=64)
    with pytest.MonkeyPatch.context() as m:
        _no_moe_rewrite(m)
        qwen2 = make_adapter(moe_dirs["qwen2_moe"], tmp_path / "q2", 1)
    cfg = ModelConfig.from_hf(load_config(moe_dirs["qwen2_moe"]))
    with pytest.raises(ValueError, match=r"shared_expert\.\w+_proj.*mixture-of-experts block"):
        load_adapter(qwen2, cfg, max_rank=64)
