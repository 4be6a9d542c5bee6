"""Shared fixtures: tiny random Llama / Qwen2 / Qwen3 / Mistral / Gemma 3 checkpoints, and
Qwen3-MoE / Mixtral / Qwen2-MoE ones, written as Hugging Face folders."""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import settings

# `make test` runs the suite on pytest-xdist workers, one per core by default: each worker, and
# every process it starts that does not choose its own, gets its share of the cores as torch
# threads, so the workers' thread pools do not oversubscribe the cores and spin against each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    _threads = str(max(1, _cores // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
    os.environ.setdefault("OMP_NUM_THREADS", _threads)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# CI replays the same examples on every run (HYPOTHESIS_PROFILE=ci, set by .ci/run), so its
# verdict is about the change, not the draw; a plain `make test` keeps exploring new ones.
settings.register_profile("ci", derandomize=True, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors; it is chosen
# when a kernel is defined, so before anything imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.3,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def _tiny_config(kind: str):
    import transformers as tf

    if kind == "llama":
        return tf.LlamaConfig(
            **TINY,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if kind == "qwen2":
        return tf.Qwen2Config(**TINY, tie_word_embeddings=False)
    if kind == "qwen3":
        return tf.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False)
    if kind == "mistral":
        return tf.MistralConfig(**TINY, sliding_window=None, tie_word_embeddings=False)
    if kind == "gemma3":  # a window shorter than most prompts; both RoPE bases; scaled global RoPE
        return tf.Gemma3TextConfig(
            **{**TINY, "num_hidden_layers": 3},
            head_dim=64,
            sliding_window=12,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=48,
            final_logit_softcapping=10.0,
            tie_word_embeddings=False,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
        )
    raise ValueError(kind)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    return {
        kind: write_tiny_model(_tiny_config(kind), tmp_path_factory.mktemp(f"tiny-{kind}"))
        for kind in ("llama", "qwen2", "qwen3", "mistral", "gemma3")
    }


MOE_KINDS = ["qwen3_moe", "mixtral", "qwen2_moe"]


def tiny_moe_config(kind: str):
    """Three layers; Qwen3-MoE keeps its middle one dense and renormalises its top-k, Qwen2-MoE
    does not and has a shared expert."""
    import transformers as tf

    base = {**TINY, "num_hidden_layers": 3, "tie_word_embeddings": False}
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **base,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
    if kind == "mixtral":
        return tf.MixtralConfig(
            **{**base, "intermediate_size": 64}, num_local_experts=4, num_experts_per_tok=2
        )
    if kind == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **base,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
        )
    raise ValueError(kind)


@pytest.fixture(scope="session")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    return {
        kind: write_tiny_model(tiny_moe_config(kind), tmp_path_factory.mktemp(f"tiny-{kind}"))
        for kind in MOE_KINDS
    }


def write_tiny_model(config, path) -> str:
    """A random model of this transformers config saved at `path` (seed 0); a Qwen2's qkv biases
    random too, so the bias path is really exercised."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if config.model_type in ("qwen2", "qwen2_moe"):
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.3)
    if (
        config.model_type == "gemma3_text"
    ):  # Gemma's norms start at w = 0 (a scale of 1 + w): make them matter
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                torch.nn.init.normal_(param, std=0.3)
    model.save_pretrained(path)
    return str(path)


def hf_greedy(model: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: Hugging Face generate, one prompt at a time, fp32, greedy; `model` a --model
    value (a GGUF's weights dequantised, as tandem reads them)."""
    from tandem.models.loader.hf_reference import hf_model

    model = hf_model(model, torch.float32)
    model.generation_config.eos_token_id = None  # like ignore_eos: EOS is a token like any other
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def pytest_collection_modifyitems(config, items):
    """Under xdist (`make test`: --dist loadfile, collection order kept) the files holding tests on
    the real model, the longest, go first, so the run ends on short files rather than on one
    worker's long one while the other waits. The order within a file is kept."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow_files = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow_files)


def random_prompts(seed: int, n: int, lo: int, hi: int) -> list[list[int]]:
    """`n` prompts of random token ids below 512, each `lo` to `hi` tokens long."""
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def token_ids(outs) -> list[list[int]]:
    """Each request's first completion's token ids."""
    return [o.outputs[0].token_ids for o in outs]
