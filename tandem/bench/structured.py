"""`tandem bench structured`: what grammar-constrained decoding costs. Output tok/s of chat
requests at a fixed concurrency with none constrained against a share of them constrained to a
typical JSON Schema, in one process and alternating rounds (so load on the machine hits both
alike); the share of step time spent filling and applying masks; and the compile time of the
schema, first and cached."""

from __future__ import annotations

import argparse
import json
import time

from tandem.bench.measure import peak_rss_mb
from tandem.config.args import add_engine_arguments

TOPICS = [
    "apple",
    "banana",
    "cherry",
    "grape",
    "lemon",
    "mango",
    "orange",
    "peach",
    "pear",
    "plum",
    "kiwi",
    "melon",
    "fig",
    "lime",
    "papaya",
    "apricot",
    "coconut",
    "guava",
    "date",
    "olive",
    "cat",
    "dog",
    "horse",
    "eagle",
    "shark",
    "owl",
    "tiger",
    "whale",
    "frog",
    "bee",
    "ant",
    "bear",
]
# Nested objects, enums, arrays, required fields: the shape of a typical extraction schema.
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "kind", "facts", "origin"],
    "properties": {
        "name": {"type": "string"},
        "kind": {"enum": ["fruit", "animal", "other"]},
        "facts": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "origin": {
            "type": "object",
            "required": ["continent"],
            "properties": {
                "continent": {"enum": ["Africa", "America", "Asia", "Europe"]},
                "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            },
        },
    },
}


def compile_times(tokenizer, vocab_size: int, eos: int | None) -> dict:
    """Seconds to build xgrammar's tokenizer info, compile SCHEMA once, and get it again."""
    from tandem.core.sampling_params import StructuredOutputsParams
    from tandem.executor.grammar_compiler import GrammarCompiler

    so = StructuredOutputsParams(json=SCHEMA)
    warm = GrammarCompiler(tokenizer, vocab_size, eos)
    t0 = time.perf_counter()
    warm.get(StructuredOutputsParams(regex="a"))  # builds the tokenizer info
    t1 = time.perf_counter()
    warm.get(so)
    t2 = time.perf_counter()
    warm.get(so)
    t3 = time.perf_counter()
    return {"tokenizer_info_s": t1 - t0, "schema_first_s": t2 - t1, "schema_cached_s": t3 - t2}


def run(args) -> dict:
    from tandem import LLM, SamplingParams
    from tandem.core.sampling_params import StructuredOutputsParams

    # No prefix cache: both arms send the same prompts, and the later arm would skip their prefill.
    llm = LLM(
        args.model,
        max_num_seqs=args.concurrency,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    compile_s = compile_times(engine.tokenizer, engine.vocab_size, engine.eos_token_id)
    prompts = [
        engine.tokenizer.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": f"Give facts about the {TOPICS[i % len(TOPICS)]} as JSON.",
                }
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(args.num_requests)
    ]
    so = StructuredOutputsParams(json=SCHEMA)
    every = max(1, round(1 / args.constrained_share)) if args.constrained_share else 0

    def params(i: int, constrained: bool) -> SamplingParams:
        return SamplingParams(
            temperature=0,
            max_tokens=args.max_tokens,
            ignore_eos=True,
            structured_outputs=so if constrained and every and i % every == 0 else None,
        )

    llm.generate(prompts[:2], [params(0, True), params(1, False)])  # warm-up, grammar compiled
    arms: dict[str, dict] = {
        "none": {"tokens": 0, "seconds": 0.0, "mask_s": 0.0, "execute_s": 0.0},
        "constrained": {"tokens": 0, "seconds": 0.0, "mask_s": 0.0, "execute_s": 0.0},
    }
    for _ in range(args.rounds):
        for arm in arms:
            mask_before = engine.step_counters().grammar_mask_seconds
            engine.reset_stats()
            start = time.perf_counter()
            outs = llm.generate(
                prompts, [params(i, arm == "constrained") for i in range(len(prompts))]
            )
            a = arms[arm]
            a["seconds"] += time.perf_counter() - start
            a["tokens"] += sum(len(o.outputs[0].token_ids) for o in outs)
            counters = engine.step_counters()
            a["mask_s"] += counters.grammar_mask_seconds - mask_before
            a["execute_s"] += counters.phase_times["execute"]
    for a in arms.values():
        a["output_throughput"] = a["tokens"] / a["seconds"]
        a["mask_share_of_execute"] = a["mask_s"] / max(a["execute_s"], 1e-9)
    return {
        "concurrency": args.concurrency,
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "constrained_share": 1 / every if every else 0.0,
        "rounds": args.rounds,
        "arms": arms,
        "throughput_ratio": arms["constrained"]["output_throughput"]
        / arms["none"]["output_throughput"],
        "compile": compile_s,
        "dtype": engine.info().dtype,
        "peak_rss_mb": peak_rss_mb(),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    # A small fixed KV pool: the requests need little, and the default takes a share of memory.
    add_engine_arguments(
        p,
        ("model", "kv_cache_memory"),
        defaults={"kv_cache_memory": 256 << 20},
        store_defaults=True,
    )
    p.add_argument(
        "--max-concurrency",
        dest="concurrency",
        type=int,
        default=16,
        help="max_num_seqs: requests decoding at once (default 16)",
    )
    p.add_argument(
        "--num-prompts", dest="num_requests", type=int, default=32, help="requests (default 32)"
    )
    p.add_argument(
        "--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos)"
    )
    p.add_argument(
        "--constrained-share", type=float, default=0.5, help="share of requests given the schema"
    )
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of each arm")
    p.add_argument("--json", help="write the results here too")


def main(args: argparse.Namespace) -> None:
    if not 0 <= args.constrained_share <= 1:
        raise ValueError("--constrained-share must be in [0, 1]")
    result = run(args)
    for name, a in result["arms"].items():
        print(
            f"{name:12s} {a['output_throughput']:8.1f} output tok/s  "
            f"({a['tokens']} tokens in {a['seconds']:.1f} s; "
            f"masks {a['mask_share_of_execute']:.1%} of executor time)"
        )
    c = result["compile"]
    print(
        f"constrained / none: {result['throughput_ratio']:.3f}; "
        f"schema compile: first {c['schema_first_s'] * 1e3:.1f} ms, "
        f"cached {c['schema_cached_s'] * 1e6:.0f} us "
        f"(tokenizer info, once: {c['tokenizer_info_s']:.2f} s); "
        f"peak RSS {result['peak_rss_mb']:.0f} MiB"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
