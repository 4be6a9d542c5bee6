"""`tandem` command line: prepare, generate, bench."""
from __future__ import annotations

import argparse
import logging
import sys


def _generate(args: argparse.Namespace) -> None:
    from tandem import LLM, SamplingParams
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed)
    llm = LLM(args.model, dtype=args.dtype)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.outputs[0].text)


def _prepare(args: argparse.Namespace) -> None:
    from tandem.models.loader import resolve_model
    print(resolve_model(args.model))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem LLM serving system")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare", help="resolve a model (convert a GGUF once into the cache)")
    p.add_argument("--model", default="smollm2-135m")
    p.set_defaults(func=_prepare)

    p = sub.add_parser("generate", help="generate text from one prompt")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.set_defaults(func=_generate)

    from tandem.server import launch
    p = sub.add_parser("serve", help="the OpenAI-compatible server")
    launch.add_arguments(p)
    p.set_defaults(func=launch.main)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    from tandem.bench import offline
    p = bench.add_parser("offline", help="offline throughput, optionally against transformers")
    offline.add_arguments(p)
    p.set_defaults(func=offline.main)

    from tandem.bench import scheduler as bench_scheduler
    p = bench.add_parser("scheduler", help="scheduler cost per step with a null executor")
    bench_scheduler.add_arguments(p)
    p.set_defaults(func=bench_scheduler.main)

    from tandem.bench import serve as bench_serve
    p = bench.add_parser("serve", help="token-level load test of an OpenAI-compatible endpoint")
    bench_serve.add_arguments(p)
    p.set_defaults(func=bench_serve.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the report
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
