"""The offline engine's read-only figures (LLMEngine.info / step_counters), which the benches
report instead of reading the scheduler, the KV manager or the model runner, and the benches
that read them, run on a tiny model."""

from __future__ import annotations

import argparse

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.bench import offline, offline_runs, quantization
from tandem.executor.kv_quant import kv_bytes_per_token
from tandem.models.config import ModelConfig
from tandem.models.loader.model_files import load_config

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(tiny_model_dirs["llama"], dtype="float32", kv_cache_memory=1 << 22, max_num_seqs=4)


def test_info_names_what_the_engine_built(llm, tiny_model_dirs):
    info = llm.engine.info()
    cfg = ModelConfig.from_hf(load_config(tiny_model_dirs["llama"]))
    assert (info.dtype, info.block_size, info.default_precision) == ("float32", 16, "fp32")
    assert info.kv_bytes_per_token == kv_bytes_per_token(cfg, torch.float32)
    assert info.num_kv_blocks == (1 << 22) // (info.kv_bytes_per_token * info.block_size)
    assert (
        list(info.weight_bytes) == ["fp32"]
        and 0 < info.decode_weight_bytes <= info.weight_bytes["fp32"]
    )
    assert not info.graphs_captured and info.graph_capture_bytes == 0  # CPU: no CUDA graphs


def test_step_counters_count_and_reset_only_the_step_figures(llm):
    prompt = list(range(1, 40))
    llm.generate([prompt], GREEDY)
    before = llm.engine.step_counters()
    llm.generate([prompt], GREEDY)  # its two whole blocks come from the prefix cache
    after = llm.engine.step_counters()
    assert after.num_steps - before.num_steps == GREEDY.max_tokens
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == 32
    assert (
        after.phase_times["execute"] > before.phase_times["execute"]
        and after.prepare_seconds > before.prepare_seconds
    )
    assert after.gpu_busy_seconds is None and after.spec.num_drafts == 0
    llm.engine.reset_stats()
    reset = llm.engine.step_counters()
    assert (reset.num_steps, reset.kv_usage_peak, reset.phase_times["execute"]) == (0, 0.0, 0.0)
    assert reset.prefix_hit_tokens == after.prefix_hit_tokens  # since start: a bench diffs it
    before.phase_times["execute"] = -1.0
    assert (
        llm.engine.step_counters().phase_times["execute"] == 0.0
    )  # a snapshot, not the engine's own


def _args(model: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    offline.add_arguments(p)
    return p.parse_args(
        ["--model", model, "--dtype", "float32", "--device", "cpu", "--no-progress"]
    )


def test_bench_offline_and_quantization_report_from_the_public_figures(tiny_model_dirs):
    args = _args(tiny_model_dirs["llama"])
    args.num_prompts, args.min_prompt, args.max_prompt, args.min_output, args.max_output = (
        3,
        4,
        20,
        3,
        5,
    )
    args.kv_cache_memory = 1 << 22
    requests = offline_runs.make_requests(args, 100)
    r = offline_runs.run_tandem(args, requests)
    assert r["output_tokens"] == sum(out for _, out in requests) and r["dtype"] == "float32"
    assert r["steps"] >= max(out for _, out in requests) and r["ms_per_step"]["prepare"] > 0
    assert r["gpu_busy_ms"] is None and r["spec_decode"] is None
    args.batch_sizes, args.prompt_len, args.output_len = "1,2", 8, 4
    q = quantization.run_precision(args, "fp32", deterministic=False)
    assert q["dtype"] == "float32" and q["weight_mib"] > 0 and set(q["decode_tok_s"]) == {1, 2}
