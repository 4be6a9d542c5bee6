"""`tandem serve`: flags and YAML config -> engine core process + API server -> uvicorn."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import fields
from typing import TYPE_CHECKING

from tandem.config import EngineConfig, load_yaml
from tandem.flags import kv_cache_dtype_argument, renamed, size_type
from tandem.server.reasoning_parser import REASONING_PARSERS
from tandem.server.tool_parsers import TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from tandem.server.state import ServerConfig


def _swap_gib(text: str) -> int:
    """--swap-space: GiB (as vLLM's) or a size with its unit; a bare byte count, as the flag
    once took, is refused naming the unit."""
    if text.strip().isdigit() and int(text) >= 1 << 20:
        raise argparse.ArgumentTypeError(f"{text} GiB is more than any host has: --swap-space is in GiB now "
                                         f"(it was bytes); write e.g. 4 or 4GiB or {text}B")
    return size_type("GiB")(text)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}); e.g. '{{\"method\": \"ngram\", "
                                         f"\"num_speculative_tokens\": 4}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"method\": \"ngram\"}'")
    return value


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (flags override --config; defaults are EngineConfig's)")
    g.add_argument("--dtype", default=None, help="auto | float32 | bfloat16 | float16 (default auto: bf16 on "
                   "AVX-512 CPUs and CUDA, else fp32)")
    g.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N (default auto)")
    g.add_argument("--quantization", default=None, help="precision served: auto, bf16, fp16, fp32, int8 or int4 "
                   "(default auto: as the weights are stored, e.g. int4 for a Q4 GGUF; several, with classes "
                   "and a fallback: serving.quantization in --config)")
    g.add_argument("--seed", type=int, default=None, help="seed of sampled requests without their own (default 0)")
    g.add_argument("--num-threads", type=int, default=None, help="CPU threads of the engine (default: all cores)")
    g.add_argument("--block-size", type=int, default=None, help="tokens per KV block, a power of two (default 16)")
    kv_cache_dtype_argument(g, default=None)
    g.add_argument("--kv-cache-memory", type=size_type("B"), default=None, metavar="SIZE",
                   help="KV pool size, e.g. 4GiB or 512MiB (a bare number is bytes); default: 90%% of free "
                        "GPU memory after the weights, or on CPU a quarter of available memory up to 2 GiB")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="size the KV pool from a share of memory instead (0-1]: on CUDA the engine's share of the "
                        "device's total memory, as vLLM; on CPU the share of host memory available after the "
                        "weights; not with --kv-cache-memory (default: unset)")
    g.add_argument("--swap-space", type=_swap_gib, default=None, metavar="GiB",
                   help="host memory for swapped-out KV blocks, in GiB or with a unit (e.g. 0.5 or 512MiB; "
                        "default 0.5 GiB)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="requests in a step at most (default 128)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens in a step at most (default 2048)")
    g.add_argument("--max-model-len", type=int, default=None, help="tokens per request, prompt and output "
                   "(default: the model's context, capped by the KV pool)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV of shared prompt prefixes (default on)")
    renamed(g, "--no-prefix-caching", "--no-enable-prefix-caching", "enable_prefix_caching", flag=False)
    g.add_argument("--max-prefix-tokens", type=int, default=None, help="tokens of a prompt the prefix cache may "
                   "serve at most (default: no limit)")
    g.add_argument("--min-match-length", type=int, default=None, help="tokens a prefix hit must cover to be used "
                   "(default 0)")
    g.add_argument("--deterministic", action="store_true", default=None,
                   help="a request's tokens do not depend on the other requests in its steps, the batch size, "
                        "chunking, prefix hits, preemption or speculation (CPU; YAML: serving.deterministic)")


def _scheduler_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scheduler")
    g.add_argument("--scheduling-policy", dest="scheduler_policy", choices=["fcfs", "multilevel"], default=None,
                   help="fcfs, or multilevel (short / priority requests first, with a floor for the rest); default fcfs")
    renamed(g, "--scheduler-policy", "--scheduling-policy", "scheduler_policy")
    g.add_argument("--queue-order", choices=["fcfs", "spf"], default=None,
                   help="within a level: arrival, or shortest prompt first (default fcfs)")
    g.add_argument("--preemption-mode", choices=["auto", "swap", "recompute"], default=None,
                   help="when KV runs out (default auto: the cheaper of the two per request)")
    g.add_argument("--l2-min-share", type=float, default=None,
                   help="multilevel: share of a step's tokens lower levels keep (default 0.2)")
    g.add_argument("--l1-hold-s", type=float, default=None,
                   help="multilevel: seconds lower levels stay throttled after L1 traffic was seen (default 2)")
    g.add_argument("--l1-step-time", type=float, default=None,
                   help="multilevel: while L1 traffic is present, size lower-level prefill so a step "
                        "takes about this many seconds (adapted from measured steps; default: their share)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step N+1 while step N runs (default on; YAML: serving.scheduler.async_scheduling)")
    add_speculative_arguments(g)


def add_speculative_arguments(g) -> None:
    """--speculative-config, and the --speculative-* spellings it replaced (see with_speculation_flags)."""
    g.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys: \'{"method": "ngram" | "draft", "model": "self:int4", '
                        '"num_speculative_tokens": 4}\' (model: the draft of method draft: self:int4 | self:int8 | '
                        'self:bf16 or another model with the same tokenizer; k 1-16, default 4); also adaptive, '
                        'prompt_lookup_min/max. Default off (YAML: serving.speculative_decoding)')
    for old, key in (("--speculative-method", "method"), ("--speculative-model", "model"),
                     ("--num-speculative-tokens", "num_speculative_tokens")):
        renamed(g, old, f"--speculative-config '{{\"{key}\": ...}}'", old[2:].replace("-", "_"),
                convert=int if key == "num_speculative_tokens" else None)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tandem.server.limits import LIMITS_HELP
    p.epilog = LIMITS_HELP
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="model alias, HF folder or GGUF file (same as --model; default smollm2-135m)")
    p.add_argument("--model", default=None, help="model alias, HF folder or GGUF file (default smollm2-135m)")
    p.add_argument("--config", help="YAML file with the `serving:` shape (flags override it; examples/serving.yaml)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names clients send as `model`, each accepted; the first is the one responses report "
                        "(default: the --model value; YAML: serving.server.served_model_name, a name or a list)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer other than the model's: a folder with tokenizer files, a tokenizer.json, or a "
                        "model (alias, .gguf, HF folder); refused if it has more tokens than the model's "
                        "embedding rows (default: the model's own; YAML: serving.engine.tokenizer)")
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="chat template in place of the tokenizer's: a Jinja file, or the template itself (a value "
                        "holding {, } or a newline); refused if Jinja cannot parse it (default: the tokenizer's "
                        "own; YAML: serving.engine.chat_template)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"), help="bearer token clients must send "
                   "(default: $TANDEM_API_KEY, else none)")
    p.add_argument("--max-waiting", type=int, default=None, help="waiting requests before answering 429 (default: no limit)")
    p.add_argument("--request-log", default=None, help="append one JSON line per finished request to this file")
    p.add_argument("--request-log-text", dest="request_log_text", action="store_true", default=None,
                   help="the request log holds each prompt and output text too (default: lengths and timings only)")
    p.add_argument("--allowed-origins", dest="allowed_origins", default=None,
                   type=lambda s: [o.strip() for o in s.split(",") if o.strip()],
                   help="comma-separated browser origins allowed cross-origin (CORS; default: none, no CORS headers)")
    p.add_argument("--max-request-bytes", dest="max_body_bytes", type=size_type("B"), default=None, metavar="SIZE",
                   help="largest request body, e.g. 4MiB (a bare number is bytes), counted while it is read "
                        "(413 past it; default 4MiB)")
    p.add_argument("--log-level", default="info", help="uvicorn's log level (default info)")
    p.add_argument("--step-trace", default=None,
                   help="append one JSON line per executed step (summarise: tandem bench steps FILE)")
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default=None,
                   help="attention kernels (default auto: Triton on CUDA when installed, else PyTorch)")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="no CUDA graphs: run decode steps eagerly too")
    p.add_argument("--role", choices=["colocated", "prefill", "decode"], default=None,
                   help="role in a cluster's model group (tandem cluster; default: none, a standalone server whose P/D routes answer 409)")
    p.add_argument("--elastic", action="store_true", default=None, help="the router may switch this role")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="reasoning as reasoning_content: <think>...</think> (default: a template "
                        "that writes <think>)")
    p.add_argument("--reasoning-budget", type=int, choices=[-1, 0], default=None,
                   help="-1: unlimited (default); 0: thinking off, by the chat template's switch")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="the model's tool-call format (default: from its chat template; generic if "
                        "it has none)")
    p.add_argument("--engine-niceness", type=int, default=0,
                   help="CPU niceness of the engine-core process, 0-19 (default 0): on a machine with few cores "
                        "the API process then runs as soon as it wakes")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds the requests in flight may take to finish before they are aborted (default 30)")
    _engine_arguments(p)
    _scheduler_arguments(p)


def with_speculation_flags(engine_opts: dict, args: argparse.Namespace) -> dict:
    """--speculative-config (and the old --speculative-* spellings) over the YAML's
    speculative_config (serving.speculative_decoding)."""
    spec = {**(engine_opts.get("speculative_config") or {}), **(getattr(args, "speculative_config", None) or {})}
    for key, flag in (("method", "speculative_method"), ("model", "speculative_model"),
                      ("num_speculative_tokens", "num_speculative_tokens")):
        if getattr(args, flag, None) is not None:
            spec[key] = getattr(args, flag)
    return {**engine_opts, "speculative_config": spec} if spec else engine_opts


def served_names(value: str | list) -> tuple[str, ...]:
    """--served-model-name's names (or the YAML's, a name or a list): non-empty and distinct."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n.strip() for n in names):
        raise ValueError(f"served model name: a non-empty name or list of names, got {value!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"served model names must be distinct, got {names}")
    return tuple(names)


def model_of(args: argparse.Namespace) -> str | None:
    """`tandem serve MODEL` or --model (one of them, or both the same)."""
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models: {args.model_tag!r} and --model {args.model!r}; give one")
    return args.model_tag or args.model


def build_configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """The engine's and the server's config: --config's `serving:` values, flags over them."""
    from tandem.server.state import ServerConfig
    engine_opts, server_opts = {}, {}
    if args.config:
        engine_opts, server_opts = load_yaml(args.config), load_yaml(args.config, section="server")
    args.model = model_of(args)
    for f in fields(EngineConfig):
        value = getattr(args, f.name, None)
        if value is not None and f.name != "speculative_config":
            engine_opts[f.name] = value
    engine_config = EngineConfig.from_dict(with_speculation_flags(engine_opts, args))
    yaml_names = server_opts.pop("served_model_name", None)
    names = served_names(args.served_model_name or yaml_names or engine_config.model)
    server = ServerConfig(model_name=names[0], model_aliases=names[1:])
    for key, value in server_opts.items():
        if not hasattr(server, key):
            raise ValueError(f"unknown server option {key!r} in {args.config}")
        setattr(server, key, value)
    for key in ("api_key", "max_waiting", "request_log", "request_log_text", "allowed_origins", "max_body_bytes",
                "role", "elastic", "tool_call_parser", "reasoning_parser", "reasoning_budget"):
        if getattr(args, key) is not None:
            setattr(server, key, getattr(args, key))
    return engine_config, server


def main(args: argparse.Namespace) -> None:
    """Two processes: this one (HTTP, tokenising, detokenising, SSE; no torch) and the engine
    core (scheduler, executor, KV pool; the cores), which dies with this one."""
    import logging
    import sys

    import uvicorn

    from tandem.engine.async_llm import AsyncLLM
    from tandem.heap import freeze_startup_heap
    from tandem.server.api_server import build_app
    from tandem.server.lifecycle import Lifecycle, RefuseWhenStopping, Server

    engine_config, server = build_configs(args)
    llm = AsyncLLM(engine_config, engine_niceness=args.engine_niceness)
    lifecycle = Lifecycle(llm, args.shutdown_timeout)
    llm.on_dead = lifecycle.engine_died
    app = build_app(llm, server)
    app.add_middleware(RefuseWhenStopping, lifecycle=lifecycle)
    freeze_startup_heap("API server")
    try:
        Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                              timeout_graceful_shutdown=1), lifecycle).run()
    finally:
        llm.shutdown()
    # Everything is written (the request log closes per line); skip the interpreter's teardown
    # (torch's destructors take 1-2 s here), so a drained server is gone within --shutdown-timeout.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(lifecycle.exit_code)
