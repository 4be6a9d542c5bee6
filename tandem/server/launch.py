"""`tandem serve`: flags and YAML config -> engine core process + API server -> uvicorn."""

from __future__ import annotations

import argparse
import os

from tandem.config import EngineConfig, load_yaml
from tandem.config.args import add_arguments as add_option_arguments
from tandem.config.args import add_engine_arguments, dataclass_options, given
from tandem.config.serving_yaml import parse_sizes
from tandem.server.state import ServerConfig

SERVER_OPTIONS = dataclass_options(ServerConfig)
SERVED_NAMES_HELP = (
    "names clients send as `model`, each accepted; the first is the one responses report"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tandem.server.limits import LIMITS_HELP

    p.epilog = LIMITS_HELP
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help=f"same as --model (default {EngineConfig().model_config.model})",
    )
    p.add_argument(
        "--config",
        help="YAML file with the `serving:` shape (flags override it; examples/serving.yaml)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help=f"{SERVED_NAMES_HELP} (default: the --model value; YAML: "
        "serving.server.served_model_name, a name or a list)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--log-level", default="info", help="uvicorn's log level (default info)")
    p.add_argument(
        "--engine-niceness",
        type=int,
        default=0,
        help="CPU niceness of the engine-core process, 0-19 (default 0): on a machine with few "
        "cores the API process then runs as soon as it wakes",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM: seconds the requests in flight may take to finish before they are "
        "aborted (default 30)",
    )
    add_option_arguments(p.add_argument_group("server (YAML: serving.server)"), SERVER_OPTIONS)
    # Flags override --config; YAML: serving.engine, or the key named in the help.
    add_engine_arguments(p)


def served_names(value: str | list) -> tuple[str, ...]:
    """--served-model-name's names (or the YAML's, a name or a list): non-empty and distinct."""
    names = [value] if isinstance(value, str) else value
    if (
        not isinstance(names, list)
        or not names
        or not all(isinstance(n, str) and n.strip() for n in names)
    ):
        raise ValueError(f"served model name: a non-empty name or list of names, got {value!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"served model names must be distinct, got {names}")
    return tuple(names)


def model_of(args: argparse.Namespace) -> str | None:
    """`tandem serve MODEL` or --model (one of them, or both the same)."""
    flag = getattr(args, "model", None)
    if args.model_tag and flag and args.model_tag != flag:
        raise ValueError(f"two models: {args.model_tag!r} and --model {flag!r}; give one")
    return args.model_tag or flag


def build_configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """The engine's and the server's config: --config's `serving:` values, flags over them."""
    engine_opts, server_opts = {}, {}
    if args.config:
        engine_opts = load_yaml(args.config)
        server_opts = parse_sizes(load_yaml(args.config, section="server"), SERVER_OPTIONS)
    model = model_of(args)
    for name, value in {**given(args), **({"model": model} if model else {})}.items():
        if isinstance(value, dict) and isinstance(engine_opts.get(name), dict):
            value = {**engine_opts[name], **value}  # a JSON flag updates the YAML's mapping
        engine_opts[name] = value
    engine_config = EngineConfig.from_kwargs(**engine_opts)
    yaml_names = server_opts.pop("served_model_name", None)
    names = served_names(args.served_model_name or yaml_names or engine_config.model_config.model)
    unknown = set(server_opts) - SERVER_OPTIONS.keys()
    set_by_names = sorted(unknown & {"model_name", "model_aliases"})
    if set_by_names:
        raise ValueError(
            f"{args.config}: {', '.join(f'serving.server.{k}' for k in set_by_names)}: the names "
            "served are serving.server.served_model_name (a name, or a list; the first is reported)"
        )
    if unknown:
        raise ValueError(f"unknown server option(s) {', '.join(sorted(unknown))} in {args.config}")
    flags = given(args, SERVER_OPTIONS)
    if "api_key" not in flags and os.environ.get("TANDEM_API_KEY"):
        flags["api_key"] = os.environ["TANDEM_API_KEY"]
    names_opts = {"model_name": names[0], "model_aliases": names[1:]}
    server = ServerConfig(**{**server_opts, **flags, **names_opts})
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
        Server(
            uvicorn.Config(
                app,
                host=args.host,
                port=args.port,
                log_level=args.log_level,
                timeout_graceful_shutdown=1,
            ),
            lifecycle,
        ).run()
    finally:
        llm.shutdown()
    # Everything is written (the request log closes per line); skip the interpreter's teardown
    # (torch's destructors take 1-2 s here), so a drained server is gone within --shutdown-timeout.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(lifecycle.exit_code)
