"""`tandem` command line: prepare, generate, bench."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from tandem.config.args import add_engine_arguments, given


def _generate(args: argparse.Namespace) -> None:
    from tandem import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
    )
    llm = LLM(**given(args, ("model", "dtype")))
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.outputs[0].text)


def _prepare(args: argparse.Namespace) -> None:
    """What a first start would otherwise do: convert the model, build the native kernels."""
    from tandem.kernels import prepare
    from tandem.models.loader.model_files import resolve_model

    print(resolve_model(args.model))
    for name, ok in prepare().items():
        print(f"kernel {name}: {'ready' if ok else 'unavailable (the PyTorch path serves)'}")


# (group, name, module with add_arguments/main, help): `tandem [group] name ...`
COMMANDS = [
    (None, "serve", "tandem.server.launch", "the OpenAI-compatible server"),
    (
        "cluster",
        "up",
        "tandem.cluster.launch.launcher",
        "start the instances of a cluster.yaml and serve the router",
    ),
    (
        "bench",
        "offline",
        "tandem.bench.offline",
        "offline throughput, optionally against transformers",
    ),
    (
        "bench",
        "load",
        "tandem.bench.load",
        "loading a model: file size, cache bytes written, peak RSS, time",
    ),
    (
        "bench",
        "fidelity",
        "tandem.tools.fidelity_cli",
        "the simulator's error against repeated real replays of a trace window",
    ),
    (
        "bench",
        "kv",
        "tandem.bench.kv",
        "KV one long request holds with sliding-window layers, against full attention",
    ),
    (
        "bench",
        "quality",
        "tandem.bench.quality",
        "perplexity, greedy agreement and batch dependence per precision",
    ),
    (
        "bench",
        "scheduler",
        "tandem.bench.scheduler",
        "scheduler cost per step with a null executor",
    ),
    (
        "bench",
        "serve",
        "tandem.bench.serve",
        "token-level load test of an OpenAI-compatible endpoint",
    ),
    (
        "bench",
        "spec",
        "tandem.bench.spec",
        "speculative decoding on and off on shipped prompt sets, batch 1 to 64",
    ),
    (
        "bench",
        "steps",
        "tandem.bench.steps",
        "where a served run's step time went, from a --step-trace file",
    ),
    (
        "bench",
        "gpu",
        "tandem.bench.gpu",
        "the GPU check: equality, throughput vs transformers, decode roofline, graphs on/off",
    ),
    (
        "bench",
        "structured",
        "tandem.bench.structured",
        "cost of structured outputs: tok/s constrained vs not, compile time",
    ),
    (
        "bench",
        "kv-transfer",
        "tandem.bench.kv_transfer",
        "KV transfer latency and bandwidth between two processes (P/D)",
    ),
    (
        "bench",
        "soak",
        "tandem.bench.soak",
        "mixed traffic with faults for a while: none lost, KV back, resources flat",
    ),
    (
        "bench",
        "llamacpp",
        "tandem.bench.llamacpp",
        "decode tok/s side by side with llama.cpp's llama-batched-bench on one GGUF",
    ),
    (
        "bench",
        "lora",
        "tandem.bench.lora",
        "offline tok/s with 1, 8, 64 LoRA adapters per rank against the base alone",
    ),
    (
        "bench",
        "fuzz",
        "tandem.bench.fuzz",
        "API fuzzing from the server's OpenAPI document (schemathesis): no 5xx, no hang",
    ),
    (None, "analyze", "tandem.tools.analyze_cli", "workload analysis of a trace or request log"),
    (
        None,
        "profile",
        "tandem.tools.profile_cli",
        "measure the executor (or a roofline) into a cost model for plan / simulate",
    ),
    (
        None,
        "plan",
        "tandem.tools.plan_cli",
        "prefill / decode instance counts and the elastic schedule for a traffic",
    ),
    (
        None,
        "simulate",
        "tandem.tools.simulate_cli",
        "discrete-event cluster simulator driven by the real scheduling code",
    ),
    (
        None,
        "random-gguf",
        "tandem.tools.random_gguf",
        "write a random-weight Llama GGUF of a named shape (1b, 3b) for speed figures",
    ),
    (
        None,
        "diagnose",
        "tandem.tools.diagnose_cli",
        "tail latency in three layers and fragmentation, from a run's records",
    ),
]


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Every command; given the command line, only the command it names is built with its
    arguments. Building one imports its module, and some import torch (seconds) that a server's
    front end process never needs."""
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem LLM serving system")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "prepare",
        help="resolve a model (a GGUF's config and tokenizer written once into the "
        "cache) and build the native kernels into their shared cache",
    )
    add_engine_arguments(p, ("model",), store_defaults=True)
    p.set_defaults(func=_prepare)

    p = sub.add_parser("generate", help="generate text from one prompt")
    add_engine_arguments(p, ("model", "dtype"))
    p.add_argument(
        "--prompt", required=True, help="the prompt text (with --chat: the user message)"
    )
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument(
        "--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature; 0 is greedy (default 0)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: keep the smallest set of tokens with this probability mass "
        "(default 1: all)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the sampled tokens (default: the engine's, 0)",
    )
    p.set_defaults(func=_generate)

    groups = {
        None: sub,
        "cluster": sub.add_parser("cluster", help="a router and N instances").add_subparsers(
            dest="cluster", required=True
        ),
        "bench": sub.add_parser("bench", help="benchmarks").add_subparsers(
            dest="bench", required=True
        ),
    }
    for group, name, module, text in COMMANDS:
        p = groups[group].add_parser(name, help=text)
        if argv is None or argv[: 2 if group else 1] == ([group, name] if group else [name]):
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(func=mod.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the report
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
