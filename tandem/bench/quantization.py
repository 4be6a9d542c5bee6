"""`tandem bench offline --quantization bf16,int8,int4`: decode tok/s of each precision at
several batch sizes, side by side in one run, with each precision's peak RSS.

A batch of B requests (prompt `--prompt-len` random tokens, `--output-len` tokens out,
ignore_eos) is prefilled, then timed from the step after every request has its first token to
the end: decode tok/s = B * (output_len - 1) / that time. Each precision runs in its own
process (its own peak RSS); `--repeats` alternates the precisions and keeps each figure's best,
which is what a shared, noisy machine allows.
"""

from __future__ import annotations

import random
import time

from tandem.bench.measure import in_subprocess, peak_rss_mb, until_first_tokens

DEFAULT_BATCHES = (1, 8, 32, 64)


def run_precision(args, precision: str, deterministic: bool, prefill: str = "together") -> dict:
    """One process: load the variant, then decode each batch size in turn. `prefill`: the B
    prompts prefill together, as served ("together"); or each first alone, one token out
    ("alone"), so that the timed batch finds every prompt in the prefix cache and all B decode
    in step from the first token on, however many steps their prompts would take (as llama.cpp's
    batch decodes after its prompt phase); or as "alone", with one prompt the B requests share
    ("shared": one prefill, one copy of its KV)."""
    import psutil

    from tandem import LLM, SamplingParams
    from tandem.executor.attention import resolve_attention_backend
    from tandem.executor.device import resolve_device, resolve_dtype, resolve_kv_cache_dtype
    from tandem.executor.kv_quant import kv_bytes_per_token
    from tandem.models.config import ModelConfig
    from tandem.models.loader.builder import resolve_precision
    from tandem.models.loader.model_files import (
        gguf_source,
        load_config,
        resolve_model,
        weight_source,
    )
    from tandem.models.loader.variants import auto_precision

    batches = [int(b) for b in args.batch_sizes.split(",")]
    # KV for the largest batch (in the KV dtype the engine will choose, with a block of slack per
    # request), not a share of the machine: peak RSS then shows the weights, not an untouched pool.
    device = resolve_device(args.device)
    if precision == "auto":  # named: the KV dtype and the report follow it
        source = weight_source(resolve_model(args.model), gguf_source(args.model))
        precision = auto_precision(source, args.dtype, resolve_dtype(args.dtype, device))
    kv_dtype = resolve_kv_cache_dtype(
        args.kv_cache_dtype,
        args.dtype,
        resolve_precision(precision, resolve_dtype(args.dtype, device), device)[2],
        device,
        resolve_attention_backend("auto", device),
    )
    kv_tokens = max(batches) * (args.prompt_len + args.output_len + 32)
    kv_memory = (
        args.kv_cache_memory
        or kv_bytes_per_token(ModelConfig.from_hf(load_config(resolve_model(args.model))), kv_dtype)
        * kv_tokens
    )
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        quantization=precision,
        max_num_seqs=max(batches),
        kv_cache_memory=kv_memory,
        num_threads=args.num_threads,
        deterministic=deterministic,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine = llm.engine
    rng = random.Random(args.seed)
    vocab, info = engine.vocab_size, engine.info()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([[1] * 16], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    # Peak RSS is set while loading (the float checkpoint is read whole, then cast or quantised);
    # the RSS after loading is what the variant keeps.
    loaded_rss_mb = psutil.Process().memory_info().rss / 2**20
    out = {
        "rss_after_load_mb": loaded_rss_mb,
        "precision": precision,
        "dtype": info.dtype,
        "kv_cache_dtype": info.kv_cache_dtype,
        "weight_mib": info.weight_bytes[precision] / 2**20,
        "decode_tok_s": {},
        "ms_per_step": {},
    }
    for b in batches:
        distinct = 1 if prefill == "shared" else b
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(distinct)]
        if prefill != "together":
            for prompt in prompts:
                llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
        prompts *= b // distinct
        until_first_tokens(engine, [engine.add_request(prompt, params) for prompt in prompts])
        steps, start = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        elapsed = time.perf_counter() - start
        out["decode_tok_s"][b] = b * (args.output_len - 1) / elapsed
        out["ms_per_step"][b] = elapsed / max(steps, 1) * 1e3
    out["peak_rss_mb"] = peak_rss_mb()
    return out


def compare(args) -> dict:
    """Every precision (with --compare-deterministic: with and without the flag, as "<p>" and
    "<p> det"), `repeats` rounds alternating; the best of each figure."""
    modes = (False, True) if args.compare_deterministic else (args.deterministic,)
    runs = [(p, d) for p in args.quantization.split(",") for d in modes]
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for precision, deterministic in runs:
            p = precision + (" det" if deterministic else "")
            r = in_subprocess(RunPrecision(precision, deterministic), args, None)
            prev = best.get(p)
            if prev is not None:
                for b, v in prev["decode_tok_s"].items():
                    if v > r["decode_tok_s"][b]:
                        r["decode_tok_s"][b], r["ms_per_step"][b] = v, prev["ms_per_step"][b]
                r["peak_rss_mb"] = max(r["peak_rss_mb"], prev["peak_rss_mb"])
            best[p] = r
    _print_table(best)
    if args.compare_deterministic:
        print(
            "deterministic / not: "
            + "; ".join(
                f"{p} "
                + ", ".join(
                    f"B={b} {best[p + ' det']['decode_tok_s'][b] / r['decode_tok_s'][b]:.2f}x"
                    for b in r["decode_tok_s"]
                )
                for p, r in best.items()
                if not p.endswith(" det")
            )
        )
    return best


class RunPrecision:
    """Picklable `fn(args, requests)` for the spawned process."""

    def __init__(self, precision: str, deterministic: bool = False, prefill: str = "together"):
        self.precision, self.deterministic, self.prefill = precision, deterministic, prefill

    def __call__(self, args, _requests) -> dict:
        return run_precision(args, self.precision, self.deterministic, self.prefill)


def _print_table(best: dict[str, dict]) -> None:
    first = next(iter(best.values()))
    batches = list(first["decode_tok_s"])
    base = best.get("bf16") or first
    print(
        f"{'precision':10} {'weights MiB':>11} {'RSS MiB':>8} {'peak RSS MiB':>12} "
        + " ".join(f"{'B=' + str(b) + ' tok/s':>13} {'ms/step':>8}" for b in batches)
    )
    for p, r in best.items():
        cells = " ".join(
            f"{r['decode_tok_s'][b]:>13.1f} {r['ms_per_step'][b]:>8.2f}" for b in batches
        )
        print(
            f"{p:10} {r['weight_mib']:>11.1f} {r['rss_after_load_mb']:>8.0f} "
            f"{r['peak_rss_mb']:>12.0f} {cells}"
        )
    if base is not first or "bf16" in best:
        print(
            "ratio to bf16: "
            + "; ".join(
                f"{p} "
                + ", ".join(
                    f"B={b} {r['decode_tok_s'][b] / base['decode_tok_s'][b]:.2f}x" for b in batches
                )
                for p, r in best.items()
                if r is not base
            )
        )
