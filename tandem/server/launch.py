"""`tandem serve`: flags and YAML config -> engine core process + API server -> uvicorn."""
from __future__ import annotations

import argparse
import os
from dataclasses import fields

from tandem.config import EngineConfig, load_yaml


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tandem.server.limits import LIMITS_HELP
    p.epilog = LIMITS_HELP
    p.add_argument("--config", help="YAML file with the `serving:` shape (flags override it)")
    p.add_argument("--model", default=None)
    p.add_argument("--served-model-name", default=None, help="name clients send as `model` (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"), help="or TANDEM_API_KEY")
    p.add_argument("--max-waiting", type=int, default=None, help="waiting requests before answering 429")
    p.add_argument("--request-log", default=None, help="append one JSON line per finished request")
    p.add_argument("--request-log-text", dest="request_log_text", action="store_true", default=None,
                   help="the request log holds each prompt and output text too (default: lengths and timings only)")
    p.add_argument("--allowed-origins", dest="allowed_origins", default=None,
                   type=lambda s: [o.strip() for o in s.split(",") if o.strip()],
                   help="comma-separated browser origins allowed cross-origin (CORS; default: none, no CORS headers)")
    p.add_argument("--max-request-bytes", dest="max_body_bytes", type=int, default=None,
                   help="largest request body in bytes, counted while it is read (413 past it; default 4194304)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--quantization", default=None, help="precision served: bf16, fp16, fp32, int8 or int4 "
                   "(several, with classes and a fallback: serving.quantization in --config)")
    for name in ("dtype", "device", "block_size", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens",
                 "max_model_len", "max_prefix_tokens", "min_match_length", "num_threads"):
        kind = str if name in ("dtype", "device") else int
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=None)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None)
    p.add_argument("--scheduler-policy", dest="scheduler_policy", choices=["fcfs", "multilevel"], default=None)
    p.add_argument("--queue-order", dest="queue_order", choices=["fcfs", "spf"], default=None)
    p.add_argument("--preemption-mode", dest="preemption_mode", choices=["auto", "swap", "recompute"], default=None)
    p.add_argument("--l2-min-share", dest="l2_min_share", type=float, default=None)
    p.add_argument("--l1-hold-s", dest="l1_hold_s", type=float, default=None,
                   help="multilevel: lower levels stay throttled this long after L1 traffic was seen")
    p.add_argument("--l1-step-time", dest="l1_step_time", type=float, default=None,
                   help="multilevel: while L1 traffic is present, size lower-level prefill so a step "
                        "takes about this many seconds (adapted from measured steps; default: their share)")
    p.add_argument("--step-trace", dest="step_trace", default=None,
                   help="append one JSON line per executed step (summarise: tandem bench steps FILE)")
    p.add_argument("--swap-space", dest="swap_space", type=int, default=None, help="bytes of host KV tier")
    p.add_argument("--async-scheduling", dest="async_scheduling", action=argparse.BooleanOptionalAction,
                   default=None, help="schedule step N+1 while step N runs (YAML: serving.scheduler.async_scheduling)")
    p.add_argument("--attention-backend", dest="attention_backend", choices=["auto", "torch", "triton"],
                   default=None, help="attention kernels (auto: Triton on CUDA when installed, else PyTorch)")
    p.add_argument("--enforce-eager", dest="enforce_eager", action="store_true", default=None,
                   help="no CUDA graphs: run decode steps eagerly too")
    p.add_argument("--speculative-method", choices=["ngram", "draft"], default=None,
                   help="speculative decoding: ngram (prompt lookup) or draft (YAML: serving.speculative_decoding)")
    p.add_argument("--speculative-model", default=None,
                   help="the draft (method draft): self:int4 | self:int8 | self:bf16, the target's own variant, or another model's alias or path with the same tokenizer")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="k, drafts verified per step (1-16)")
    p.add_argument("--role", choices=["colocated", "prefill", "decode"], default=None,
                   help="role in a cluster's model group (tandem cluster)")
    p.add_argument("--elastic", action="store_true", default=None, help="the router may switch this role")
    p.add_argument("--engine-niceness", type=int, default=0,
                   help="CPU niceness of the engine-core process (0-19): on a machine with few cores, the API "
                        "process then runs as soon as it wakes (docs/benchmarks.md §24)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds the requests in flight may take to finish before they are aborted")


def with_speculation_flags(engine_opts: dict, args: argparse.Namespace) -> dict:
    """The --speculative-* flags over the YAML's speculative_config (serving.speculative_decoding)."""
    spec = dict(engine_opts.get("speculative_config") or {})
    for key, flag in (("method", "speculative_method"), ("model", "speculative_model"),
                      ("num_speculative_tokens", "num_speculative_tokens")):
        if getattr(args, flag) is not None:
            spec[key] = getattr(args, flag)
    return {**engine_opts, "speculative_config": spec} if spec else engine_opts


def main(args: argparse.Namespace) -> None:
    """Two processes: this one (HTTP, tokenising, detokenising, SSE; one torch thread) and the
    engine core (scheduler, executor, KV pool; the cores), which dies with this one."""
    import logging
    import sys

    import torch
    import uvicorn

    from tandem.engine.async_llm import AsyncLLM
    from tandem.server.api_server import ServerConfig, build_app
    from tandem.server.lifecycle import Lifecycle, RefuseWhenStopping, Server

    torch.set_num_threads(1)  # no torch math here: the engine process has the cores
    engine_opts, server_opts = {}, {}
    if args.config:
        engine_opts, server_opts = load_yaml(args.config), load_yaml(args.config, section="server")
    for f in fields(EngineConfig):
        value = getattr(args, f.name, None)
        if value is not None:
            engine_opts[f.name] = value
    engine_config = EngineConfig.from_dict(with_speculation_flags(engine_opts, args))
    server = ServerConfig(model_name=args.served_model_name or server_opts.pop("served_model_name", None)
                          or engine_config.model)
    for key, value in server_opts.items():
        if not hasattr(server, key):
            raise ValueError(f"unknown server option {key!r} in {args.config}")
        setattr(server, key, value)
    for key in ("api_key", "max_waiting", "request_log", "request_log_text", "allowed_origins", "max_body_bytes",
                "role", "elastic"):
        if getattr(args, key) is not None:
            setattr(server, key, getattr(args, key))
    llm = AsyncLLM(engine_config, engine_niceness=args.engine_niceness)
    lifecycle = Lifecycle(llm, args.shutdown_timeout)
    llm.on_dead = lifecycle.engine_died
    app = build_app(llm, server)
    app.add_middleware(RefuseWhenStopping, lifecycle=lifecycle)
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
