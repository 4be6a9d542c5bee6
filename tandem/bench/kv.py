"""`tandem bench kv`: the KV one long request holds on a model with sliding-window layers (Gemma 3),
against what full attention in every layer would hold for the same tokens.

One request of `--prompt-len` random tokens, prefilled in chunks of `--max-num-batched-tokens`,
then `--output-len` tokens decoded; the engine is stepped by hand and after each step the KV
manager's blocks held are read, in bytes (a block holds one KV group's layers: kv_groups.py). The
full-attention figure is every layer's K/V for every token, in whole blocks. The pool's budget is
that figure in fp32, whatever `--kv-cache-dtype`: the tokens it holds (every KV group holding each)
compare KV dtypes at one budget.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from tandem.config.args import add_engine_arguments, given

# max_num_batched_tokens: the prefill chunk
ENGINE_OPTIONS = ("model", "dtype", "kv_cache_dtype", "quantization", "max_num_batched_tokens")


def add_arguments(p: argparse.ArgumentParser) -> None:
    # Gemma 3 by default: the comparison needs sliding-window layers, which SmolLM2 has none of.
    add_engine_arguments(p, ENGINE_OPTIONS, defaults={"model": "gemma3-270m"}, store_defaults=True)
    p.add_argument("--prompt-len", type=int, default=8192, help="prompt tokens (default 8192)")
    p.add_argument(
        "--output-len", type=int, default=32, help="tokens decoded after it (default 32)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt (default 0)")
    p.add_argument(
        "--json", dest="json_path", default=None, help="also write the figures as JSON to this path"
    )


def main(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch

    from tandem import LLM, SamplingParams
    from tandem.bench.report import mib
    from tandem.executor.kv_quant import kv_bytes_per_token
    from tandem.models.config import ModelConfig
    from tandem.models.loader.model_files import load_config, resolve_model

    if args.prompt_len < 1 or args.output_len < 1:
        raise ValueError("--prompt-len and --output-len must be at least 1")
    cfg = ModelConfig.from_hf(load_config(resolve_model(args.model)))
    total = args.prompt_len + args.output_len
    block_size = 16
    blocks = -(-total // block_size)
    # room for the full-attention layout of the request, so the figure is what it holds,
    # not what fits
    per_token_fp32 = kv_bytes_per_token(cfg, torch.float32)
    budget = (blocks + 2) * block_size * per_token_fp32
    llm = LLM(
        **given(args, ENGINE_OPTIONS),
        block_size=block_size,
        max_model_len=total,
        kv_cache_memory=budget,
        enable_prefix_caching=False,
    )
    core = llm.engine.core
    kv, cache = core.kv_manager, core.executor.kv
    block_bytes = cache.kv_cache[:, :, :block_size].numel() * cache.kv_cache.element_size()
    full_bytes = blocks * block_size * kv_bytes_per_token(cfg, cache.kv_cache.dtype)
    prompt = (
        np.random.default_rng(args.seed).integers(10, cfg.vocab_size - 10, args.prompt_len).tolist()
    )
    llm.engine.add_request(
        prompt, SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    )
    held: list[int] = []
    with tqdm(total=total, desc="tokens", unit="tok") as bar:
        while True:
            llm.engine.step()
            if not llm.engine.has_unfinished_requests():
                break
            held.append(
                kv.num_blocks - kv.num_free_blocks
            )  # after the step, before the next frees any
            bar.update(sum(r.num_computed_tokens for r in core.scheduler.running) - bar.n)
    report = {
        "model": args.model,
        "dtype": str(cache.kv_cache.dtype).removeprefix("torch."),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "kv_groups": [("full" if w is None else f"window {w}") for w in kv.group_windows],
        "layers_per_group": cache.groups.layers_per_group,
        "peak_held_bytes": max(held) * block_bytes,
        "held_bytes_last_step": held[-1] * block_bytes,
        "full_attention_bytes": full_bytes,
        "budget_bytes": budget,
        "budget_tokens": kv.num_blocks // len(kv.group_windows) * block_size,
    }
    report["last_step_vs_full"] = round(report["held_bytes_last_step"] / full_bytes, 3)
    report["peak_vs_full"] = round(report["peak_held_bytes"] / full_bytes, 3)
    print(
        f"{args.model} ({report['dtype']} KV), {args.prompt_len} + {args.output_len} tokens, "
        f"{len(kv.group_windows)} KV group(s) of {cache.groups.layers_per_group} layers: "
        f"held while decoding {mib(report['held_bytes_last_step'])} "
        f"({report['last_step_vs_full']}x), "
        f"peak {mib(report['peak_held_bytes'])} ({report['peak_vs_full']}x); "
        f"full attention in every layer: {mib(full_bytes)}; "
        f"a budget of {mib(budget)} holds {report['budget_tokens']} tokens"
    )
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    return report
