"""With deterministic=True a request's tokens equal its single-request run, in fp32, bf16, int8
and int4, greedy and seeded, whatever shares its steps: random request mixes, step and chunk
sizes, prefix hits, preemption (swap and recompute), n-gram speculation, async scheduling.

Tiny random models with head_dim 64 (the paged kernel's; every position attends on it here)."""

from __future__ import annotations

import pytest
from conftest import random_prompts, token_ids, write_tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem import LLM, SamplingParams
from tandem.kernels import cpu_invariant_gemm, cpu_paged_decode

pytestmark = pytest.mark.skipif(
    cpu_invariant_gemm() is None or cpu_paged_decode(64) is None,
    reason="no C++ toolchain for the native kernels",
)
TINY = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
    initializer_range=0.3,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
MAX_NEW = 10
# precision -> engine options
PRECISIONS = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "int4": {"dtype": "float32", "quantization": "int4"},
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """A tied-embedding Llama and a Qwen2 (qkv biases, untied head)."""
    import transformers as tf

    return {
        kind: write_tiny_model(config, tmp_path_factory.mktemp(f"det-{kind}"))
        for kind, config in (
            ("llama", tf.LlamaConfig(**TINY, tie_word_embeddings=True)),
            ("qwen2", tf.Qwen2Config(**TINY, tie_word_embeddings=False)),
        )
    }


def _prompts() -> list[list[int]]:
    """Mixed lengths; some share a 40-token prefix (prefix hits), some repeat a pattern (n-gram
    drafts)."""
    shared = random_prompts(5, 1, 40, 40)[0]
    plain = random_prompts(6, 4, 2, 70)
    prefixed = [shared + p for p in random_prompts(7, 2, 1, 9)]
    repeating = [[7, 8, 9, 10, 11] * 6, [3, 1, 4, 1, 5] * 4 + [9, 2, 6]]
    return plain + prefixed + repeating


PROMPTS = _prompts()


def _params(seeded: bool, i: int) -> SamplingParams:
    if seeded:
        return SamplingParams(
            temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=MAX_NEW, ignore_eos=True
        )
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def _generate(llm: LLM, seeded: bool, indices: list[int]) -> list[list[int]]:
    outs = llm.generate(
        [PROMPTS[i] for i in indices], [_params(seeded, i) for i in indices], use_tqdm=False
    )
    return token_ids(outs)


def _llm(path: str, precision: str, **options) -> LLM:
    return LLM(path, deterministic=True, **PRECISIONS[precision], **options)


@pytest.fixture(scope="module")
def alone(model_dirs) -> dict:
    """(kind, precision, seeded) -> each prompt's tokens, run alone (one request at a time, no
    prefix cache)."""
    out = {}
    for kind, path in model_dirs.items():
        for precision in PRECISIONS:
            llm = _llm(path, precision, enable_prefix_caching=False, kv_cache_memory=1 << 22)
            for seeded in (False, True):
                out[kind, precision, seeded] = [
                    _generate(llm, seeded, [i])[0] for i in range(len(PROMPTS))
                ]
    return out


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kind=st.sampled_from(["llama", "qwen2"]),
    precision=st.sampled_from(list(PRECISIONS)),
    seeded=st.booleans(),
    indices=st.lists(st.integers(0, len(PROMPTS) - 1), min_size=1, max_size=8, unique=True),
    max_num_batched_tokens=st.sampled_from([8, 17, 64, 2048]),
    max_num_seqs=st.integers(1, 8),
    prefix_caching=st.booleans(),
    preemption=st.sampled_from([None, "swap", "recompute"]),
    ngram=st.booleans(),
    async_scheduling=st.booleans(),
)
def test_a_request_is_its_single_request_run(
    model_dirs,
    alone,
    kind,
    precision,
    seeded,
    indices,
    max_num_batched_tokens,
    max_num_seqs,
    prefix_caching,
    preemption,
    ngram,
    async_scheduling,
):
    options = dict(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=prefix_caching,
        async_scheduling=async_scheduling,
        max_model_len=96,
        # a pool of 16 blocks of 8 tokens cannot hold several requests: preemption
        kv_cache_memory=1 << 22
        if preemption is None
        else 16 * 8 * 512 * (1 if precision == "bf16" else 2),
        preemption_mode=preemption or "auto",
        block_size=8 if preemption else 16,
    )
    if ngram:
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3}
    got = _generate(_llm(model_dirs[kind], precision, **options), seeded, indices)
    assert got == [alone[kind, precision, seeded][i] for i in indices]


def test_speculation_on_gives_the_tokens_of_speculation_off(model_dirs, alone):
    """bf16, every prompt in one batch with 4 n-gram drafts a step, greedy and seeded."""
    path = model_dirs["llama"]
    for seeded in (False, True):
        llm = _llm(
            path, "bf16", speculative_config={"method": "ngram", "num_speculative_tokens": 4}
        )
        spec = _generate(llm, seeded, list(range(len(PROMPTS))))
        assert spec == alone["llama", "bf16", seeded]
