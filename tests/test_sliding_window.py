"""Sliding windows wherever transformers applies them: Mistral's on every layer, Qwen2's and
Qwen3's (use_sliding_window) on the layers from max_window_layers on. fp32 greedy tokens on tiny
random models with a window shorter than prompt + output equal transformers' alone, batched,
prefilled in small chunks and after prefix hits; the blocks behind the window go back to the pool
through the KV groups."""

from __future__ import annotations

import pytest
import transformers as tf
from conftest import TINY, hf_greedy, random_prompts, token_ids, write_tiny_model

from tandem import LLM, SamplingParams
from tandem.models.config import ModelConfig

WINDOW, MAX_NEW = 8, 12
CONFIGS = {
    "mistral": lambda: tf.MistralConfig(**TINY, sliding_window=WINDOW),
    # two layers: the first full, the second windowed
    "qwen2": lambda: tf.Qwen2Config(
        **TINY, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
    "qwen3": lambda: tf.Qwen3Config(
        **TINY, head_dim=32, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
}
GROUPS = {"mistral": (WINDOW,), "qwen2": (None, WINDOW), "qwen3": (None, WINDOW)}


@pytest.fixture(scope="module")
def window_dirs(tmp_path_factory) -> dict[str, str]:
    return {k: write_tiny_model(make(), tmp_path_factory.mktemp(k)) for k, make in CONFIGS.items()}


SHARED = random_prompts(5, 1, 24, 24)[0]
PROMPTS = random_prompts(4, 4, 3, 40) + [SHARED + p for p in random_prompts(6, 3, 2, 9)]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def _llm(path: str, **kw) -> LLM:
    return LLM(path, dtype="float32", kv_cache_memory=1 << 22, **kw)


def test_layer_windows_are_the_layers_transformers_windows():
    def windows(config) -> list[int | None] | None:
        return ModelConfig.from_hf(config.to_dict()).layer_windows

    assert windows(CONFIGS["mistral"]()) == [WINDOW, WINDOW]
    assert windows(tf.MistralConfig(**TINY, sliding_window=None)) is None
    assert windows(CONFIGS["qwen2"]()) == [None, WINDOW]
    assert windows(tf.Qwen2Config(**TINY, sliding_window=WINDOW, max_window_layers=1)) is None
    qwen = tf.Qwen2Config(**{**TINY, "num_hidden_layers": 4}, use_sliding_window=True)
    assert qwen.sliding_window == 4096 and qwen.max_window_layers == 28
    assert windows(qwen) is None  # every layer below max_window_layers: none windowed
    typed = tf.Qwen3Config(
        **TINY,
        use_sliding_window=True,
        sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 2,
    )
    assert windows(typed) == [WINDOW, WINDOW]
    old_style = {**CONFIGS["qwen2"]().to_dict(), "layer_types": None}  # derived as transformers
    assert ModelConfig.from_hf(old_style).layer_windows == [None, WINDOW]


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_greedy_tokens_equal_transformers(kind, window_dirs):
    """Alone, batched, in chunks of 8 tokens, and again with the shared prefix cached."""
    path = window_dirs[kind]
    ref = hf_greedy(path, PROMPTS, MAX_NEW)
    llm = _llm(path)
    assert llm.engine.core.kv_manager.group_windows == GROUPS[kind]
    assert token_ids(llm.generate(PROMPTS[:1], GREEDY)) == ref[:1]
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == ref
    chunked = _llm(path, max_num_batched_tokens=8, block_size=4)
    assert token_ids(chunked.generate(PROMPTS, GREEDY)) == ref
    stats = chunked.engine.core.kv_manager.stats
    hits = stats.hits
    assert token_ids(chunked.generate(PROMPTS[4:], GREEDY)) == ref[4:]
    assert stats.hits - hits >= 3 * 24  # each prompt again: at least its shared prefix cached


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_blocks_behind_the_window_go_back_to_the_pool(kind, window_dirs):
    """A 40-token prompt in blocks of 4, decoded 10 tokens: the windowed layers hold about
    window / block_size blocks each, the full layers all of theirs."""
    path, prompt = window_dirs[kind], random_prompts(7, 1, 40, 40)[0]
    llm = _llm(path, block_size=4, max_num_batched_tokens=16, enable_prefix_caching=False)
    kv = llm.engine.core.kv_manager
    llm.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    held, out = [], None
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            out = o
        held.append(kv.num_blocks - kv.num_free_blocks)
    assert out.outputs[0].token_ids == hf_greedy(path, [prompt], 10)[0]
    full = (40 + 10) // 4  # a full-attention group's blocks at the end
    window = WINDOW // 4 + 2  # the window's blocks, the next token's and the one it leaves
    expected = window if kind == "mistral" else full + window
    assert max(held[-3:]) <= expected < len(GROUPS[kind]) * full
    assert kv.num_free_blocks == kv.num_blocks
