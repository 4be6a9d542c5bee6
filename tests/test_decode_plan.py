"""The decode plan (models/decode_plan.py): where it is built (Llama-family and Gemma 3 layers on
the integer kernel), its steps give the modules' logits bit for bit; where a layer would take
another path, it is not built."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import TINY, write_tiny_model
from gguf import GGMLQuantizationType as Q
from test_gguf_serving import Q4_K_M, _integer_kernel, _prompts, write_quantised_gguf

from tandem import LLM, SamplingParams
from tandem.models.decode_plan import DecodePlan
from tandem.models.layers.linear import Linear

pytestmark = pytest.mark.skipif(
    not _integer_kernel(), reason="the plan runs the integer kernel's layers"
)
# every decode step's top logprobs: equal floats, not just equal tokens
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)


def _outputs(llm: LLM) -> list[tuple[list[int], list]]:
    return [
        (o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(_prompts(), PARAMS)
    ]


def _assert_the_plans_steps_equal_the_modules(llm: LLM, monkeypatch) -> None:
    model = llm.engine.core.executor.model
    plan = model.decode_plan
    assert plan is not None
    ran = []
    run = DecodePlan.run
    monkeypatch.setattr(DecodePlan, "run", lambda self, *a: ran.append(r := run(self, *a)) or r)
    with_plan = _outputs(llm)
    assert any(r is not None for r in ran) and any(r is None for r in ran)  # decode steps; prefills
    model.decode_plan = None
    assert _outputs(llm) == with_plan


@pytest.mark.parametrize(
    "kinds, default",
    [(Q4_K_M, Q.Q4_K), ({"token_embd": Q.Q8_0}, Q.Q8_0)],
    ids=["q4_k_m-row-parts", "q8_0"],
)
def test_the_plans_steps_equal_the_modules(tmp_path, monkeypatch, kinds, default) -> None:
    # no prefix cache: the second pass would prefill less, so its logits could differ in the
    # last bits
    llm = LLM(
        str(write_quantised_gguf(Path(tmp_path) / "m.gguf", kinds, default)),
        dtype="float32",
        kv_cache_memory=1 << 22,
        enable_prefix_caching=False,
    )
    _assert_the_plans_steps_equal_the_modules(llm, monkeypatch)


def test_gemma3_steps_equal_the_modules(tiny_model_dirs, monkeypatch) -> None:
    """Gemma 3: QK-norm, sliding-window layers with their own RoPE table and metadata, norms after
    the attention and the MLP, the scaled embedding; the prompts outrun the tiny model's window
    of 12."""
    llm = LLM(
        tiny_model_dirs["gemma3"],
        dtype="float32",
        quantization="int4",
        kv_cache_memory=1 << 22,
        enable_prefix_caching=False,
    )
    _assert_the_plans_steps_equal_the_modules(llm, monkeypatch)


def test_qk_norm_llama_steps_equal_the_modules(tmp_path, monkeypatch) -> None:
    """A Llama layer with QK-norm (Qwen3), at a head_dim the native decode attention takes (the
    shared tiny Qwen3's 32 is not one, so its plan never runs a step)."""
    import transformers as tf

    path = write_tiny_model(
        tf.Qwen3Config(**TINY, head_dim=64, tie_word_embeddings=False), tmp_path
    )
    llm = LLM(
        path,
        dtype="float32",
        quantization="int4",
        kv_cache_memory=1 << 22,
        enable_prefix_caching=False,
    )
    _assert_the_plans_steps_equal_the_modules(llm, monkeypatch)


def test_which_models_get_a_plan(tiny_model_dirs) -> None:
    def plan_of(kind: str, **kw) -> DecodePlan | None:
        llm = LLM(tiny_model_dirs[kind], dtype="float32", kv_cache_memory=1 << 22, **kw)
        return llm.engine.core.executor.model.decode_plan

    assert plan_of("llama", quantization="int4") is not None
    assert plan_of("llama") is None  # float linears
    assert plan_of("qwen2", quantization="int4") is None  # a bias on qkv
    assert plan_of("qwen3", quantization="int4") is not None  # QK-norm
    assert plan_of("gemma3", quantization="int4") is not None
    assert plan_of("gemma3") is None  # float linears


def test_a_float_linear_among_quantised_ones_means_no_plan(tiny_model_dirs) -> None:
    model = LLM(
        tiny_model_dirs["llama"], dtype="float32", quantization="int4", kv_cache_memory=1 << 22
    ).engine.core.executor.model
    attn = model.layers[-1].self_attn
    attn.o_proj = Linear(attn.o_proj.in_features, attn.o_proj.out_features)
    assert DecodePlan.build(model) is None
