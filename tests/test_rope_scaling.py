"""YaRN and dynamic NTK RoPE scaling, computed as transformers computes them: the tables equal its
rotary embedding bit for bit, and fp32 greedy tokens on tiny random models equal transformers'
alone, batched, prefilled in small chunks and after prefix hits; the context the config allows,
and refused past it; YaRN read back from a GGUF as llama.cpp's converter writes it."""

from __future__ import annotations

import copy
from pathlib import Path

import gguf
import pytest
import torch
import transformers as tf
from conftest import TINY, hf_greedy, random_prompts, token_ids, write_tiny_model
from gguf_fixture import write_gguf

from tandem import LLM, SamplingParams
from tandem.models.config import ModelConfig
from tandem.models.layers.rotary_embedding import RotaryEmbedding
from tandem.models.loader.hf_reference import hf_model
from tandem.models.loader.model_files import load_config, resolve_model

MAX_NEW = 24
# dynamic NTK past 48 positions (the original context), to 96
DYNAMIC = dict(max_position_embeddings=48, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
YARN = dict(
    max_position_embeddings=128,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
    },
)


@pytest.fixture(scope="module")
def scaled_dirs(tmp_path_factory) -> dict[str, str]:
    configs = {
        "dynamic": _config(tf.LlamaConfig, DYNAMIC, tie_word_embeddings=True),
        "yarn": _config(tf.Qwen2Config, YARN),
    }
    return {k: write_tiny_model(c, tmp_path_factory.mktemp(k)) for k, c in configs.items()}


def _config(cls, fields: dict, **kw):
    """A tiny config of `cls` (transformers writes into the rope dict it is given: a copy)."""
    return cls(**{**TINY, **copy.deepcopy(fields)}, **kw)


# Prompts within the original context (transformers' generate turns a longer prompt whole by
# one set; see RotaryEmbedding), decoded past it; some share a 28-token prefix.
SHARED = random_prompts(5, 1, 28, 28)[0]
PROMPTS = random_prompts(4, 4, 26, 40) + [SHARED + p for p in random_prompts(6, 3, 2, 9)]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def _llm(path: str, **kw) -> LLM:
    return LLM(path, dtype="float32", kv_cache_memory=1 << 22, **kw)


@pytest.mark.parametrize(
    "config",
    [
        DYNAMIC,
        YARN,
        {"max_position_embeddings": 64, "rope_scaling": {"type": "yarn", "factor": 2.0}},
        {
            "max_position_embeddings": 64,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 8,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "truncate": False,
            },
        },
        {"max_position_embeddings": 64, "rope_scaling": {"type": "dynamic", "factor": 3}},
    ],
)
def test_table_equals_transformers_rotary_embedding(config, tmp_path):
    """Every row of the table is transformers' cos and sin for that position, fed one token at a
    time (dynamic NTK recomputes its frequencies as the sequence grows)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    _config(tf.LlamaConfig, config).save_pretrained(tmp_path)
    cfg = ModelConfig.from_hf(load_config(tmp_path))
    ours = RotaryEmbedding(cfg.head_dim, cfg.max_context_len, cfg.rope_theta, cfg.rope_scaling)
    ours.cos_sin = ours._table(cfg.max_context_len)
    reference = LlamaRotaryEmbedding(tf.LlamaConfig.from_pretrained(tmp_path))
    half = cfg.head_dim // 2
    for p in range(cfg.max_context_len):
        cos, sin = reference(torch.zeros(1), torch.tensor([[p]]))
        assert torch.equal(ours.cos_sin[p], torch.cat([cos[0, 0, :half], sin[0, 0, :half]])), p


@pytest.mark.parametrize("kind", ["dynamic", "yarn"])
def test_greedy_tokens_equal_transformers(kind, scaled_dirs):
    """Alone, batched, in chunks of 8 tokens, and again with the shared prefix cached."""
    path = scaled_dirs[kind]
    ref = hf_greedy(path, PROMPTS, MAX_NEW)
    if kind == "dynamic":  # decoded past the original context: the recomputed sets are used
        assert all(len(p) < 48 < len(p) + MAX_NEW for p in PROMPTS)
    llm = _llm(path)
    assert token_ids(llm.generate(PROMPTS[:1], GREEDY)) == ref[:1]
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == ref
    chunked = _llm(path, max_num_batched_tokens=8, block_size=4)
    assert token_ids(chunked.generate(PROMPTS, GREEDY)) == ref
    stats = chunked.engine.core.kv_manager.stats
    hits = stats.hits
    assert token_ids(chunked.generate(PROMPTS[4:], GREEDY)) == ref[4:]
    assert stats.hits - hits >= 3 * 28  # each prompt again: at least its shared prefix cached


def test_dynamic_prompt_past_the_original_context_is_turned_position_by_position(scaled_dirs):
    """A 60-token prompt (original context 48) gives transformers' tokens when it is fed one
    token at a time: each position turned by the set for its own length."""
    path = scaled_dirs["dynamic"]
    prompt = random_prompts(7, 1, 60, 60)[0]
    model = hf_model(path)
    cache, ids, out = tf.DynamicCache(), list(prompt), []
    with torch.inference_mode():
        for p in range(len(prompt) + 8 - 1):
            logits = model(torch.tensor([[ids[p]]]), past_key_values=cache, use_cache=True).logits
            if p >= len(prompt) - 1:
                ids.append(int(logits[0, -1].argmax()))
                out.append(ids[-1])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = _llm(path, max_num_batched_tokens=16).generate([prompt], params)
    assert got[0].outputs[0].token_ids == out


def test_context_the_config_allows_and_no_further(scaled_dirs):
    """YaRN and dynamic NTK stretch the original context by their factor; max_model_len past
    what the config allows is refused in words."""
    dynamic = ModelConfig.from_hf(load_config(scaled_dirs["dynamic"]))
    assert (dynamic.max_position_embeddings, dynamic.max_context_len) == (48, 96)
    qwen25 = ModelConfig.from_hf(
        {
            **load_config(scaled_dirs["yarn"]),
            "max_position_embeddings": 32768,
            "rope_scaling": {
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
            },
        }
    )
    assert qwen25.max_context_len == 131072
    assert _llm(scaled_dirs["dynamic"], max_model_len=96).engine.core.max_model_len == 96
    with pytest.raises(ValueError, match="max_model_len 97 exceeds the 96 positions"):
        _llm(scaled_dirs["dynamic"], max_model_len=97)
    with pytest.raises(ValueError, match="unsupported rope scaling type 'su'"):
        ModelConfig.from_hf({**load_config(scaled_dirs["yarn"]), "rope_scaling": {"type": "su"}})


def _gguf_with_yarn(tmp_path: Path) -> Path:
    """The tiny YaRN Qwen2 as a GGUF, its rope_scaling written as convert_hf_to_gguf writes it."""
    torch.manual_seed(0)
    model = tf.Qwen2ForCausalLM(_config(tf.Qwen2Config, YARN))
    scaling, path = YARN["rope_scaling"], tmp_path / "tiny-yarn.gguf"
    add_freq_base = gguf.GGUFWriter.add_rope_freq_base

    def add_with_yarn(writer: gguf.GGUFWriter, value: float) -> None:
        add_freq_base(writer, value)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(scaling["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(scaling["beta_slow"])

    with pytest.MonkeyPatch.context() as m:
        m.setattr(gguf.GGUFWriter, "add_rope_freq_base", add_with_yarn)
        write_gguf(model.eval(), path, "qwen2")
    return path


def test_yarn_read_back_from_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    path = str(_gguf_with_yarn(tmp_path))
    cfg = ModelConfig.from_hf(load_config(resolve_model(path)))
    assert cfg.rope_scaling == {**YARN["rope_scaling"], "rope_type": "yarn"}
    assert cfg.max_context_len == 128
    prompts = PROMPTS[:3]
    assert token_ids(_llm(path).generate(prompts, GREEDY)) == hf_greedy(path, prompts, MAX_NEW)
