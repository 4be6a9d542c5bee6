"""`bench gpu`'s equality part: greedy tokens against transformers' in fp32 on the device, for a
mixed batch, chunked prefill with preemption and prefix-cache hits, with CUDA graphs on and
off."""

from __future__ import annotations

import random

from tandem.bench.measure import new_llm


def _hf_greedy(model: str, prompts: list[list[int]], max_new: int, device) -> list[list[int]]:
    import torch

    from tandem.models.loader.hf_reference import hf_model

    model = hf_model(model, torch.float32).to(device)
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def check_equality(model: str, device: str, max_new: int, n: int, vocab: int) -> dict:
    """{case: {"graphs"|"eager": {"equal", "mismatched", ...}}} against transformers' greedy tokens,
    in fp32 (a GGUF's weights dequantised on both sides)."""
    import torch

    from tandem import SamplingParams
    from tandem.executor.kv_quant import kv_bytes_per_token
    from tandem.models.config import ModelConfig
    from tandem.models.loader.model_files import load_config, resolve_model

    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(4, 200))] for _ in range(n)]
    shared = [rng.randrange(vocab) for _ in range(64)]
    prefixed = [
        shared + [rng.randrange(vocab) for _ in range(rng.randint(1, 20))] for _ in range(3)
    ]
    ref = _hf_greedy(model, prompts + prefixed, max_new, torch.device(device))
    longest = max(map(len, prompts)) + max_new
    per_block = (
        kv_bytes_per_token(ModelConfig.from_hf(load_config(resolve_model(model))), torch.float32)
        * 16
    )
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    cases = {  # name: (engine options, prompts, reference)
        "mixed_batch": ({}, prompts, ref[:n]),
        "chunked_prefill_preemption": (
            {
                "max_num_batched_tokens": 64,
                "enable_prefix_caching": False,
                # room for the longest request and two blocks more: preemptions
                "kv_cache_memory": per_block * (longest // 16 + 3),
            },
            prompts,
            ref[:n],
        ),
        "prefix_hits": ({}, prefixed, ref[n:]),
    }
    report = {}
    for name, (opts, ps, expected) in cases.items():
        for eager in (False, True):
            llm = new_llm(
                model,
                dtype="float32",
                quantization="fp32",
                device=device,
                enforce_eager=eager,
                **{"kv_cache_memory": 256 << 20, **opts},
            )
            if name == "prefix_hits":
                outs = llm.generate(ps[:1], params) + llm.generate(ps[1:], params)
            else:
                outs = llm.generate(ps, params)
            got = [o.outputs[0].token_ids for o in outs]
            mismatched = [i for i, (a, b) in enumerate(zip(got, expected)) if a != b]
            counters = llm.engine.step_counters()
            report.setdefault(name, {})["eager" if eager else "graphs"] = {
                "equal": not mismatched,
                "mismatched": mismatched,
                "requests": len(ps),
                "graphs_captured": llm.engine.info().graphs_captured,
                "preemptions": counters.num_preemptions,
                "prefix_hit_tokens": counters.prefix_hit_tokens,
            }
            llm.engine.shutdown()
    return report
