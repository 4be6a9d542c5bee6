"""`tandem cluster up --config cluster.yaml`: start every instance (local processes, or Ray
actors), wait until each answers /health, then serve the router in this process. An instance
that dies is reported and restarted or left out (its group's `restart`). SIGTERM or SIGINT
(or any exit) drains and stops every instance it started, and it exits once they are gone."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import threading

from tandem.cluster.config import ClusterConfig, load_cluster_config
from tandem.cluster.launch.local_backend import LocalBackend
from tandem.cluster.launch.ray_backend import RayBackend

log = logging.getLogger(__name__)
CHECK_INTERVAL_S = 0.5  # how often the instances are checked for one that died


def make_backend(cfg: ClusterConfig) -> LocalBackend | RayBackend:
    return RayBackend(cfg) if cfg.backend == "ray" else LocalBackend(cfg)


class Shutdown(Exception):
    """SIGTERM or SIGINT: stop the cluster."""


@contextlib.contextmanager
def stop_on_signals():
    """SIGTERM and SIGINT raise Shutdown in the main thread, once, and not after the function
    this yields is called (the cleanup has begun): a signal then is only logged, since raising
    would cut the instances' cleanup short."""
    armed = True

    def handler(signum: int, _frame) -> None:
        nonlocal armed
        name = signal.Signals(signum).name
        if not armed:
            log.warning(
                "%s: already stopping (instances still running get SIGKILL after stop_timeout_s)",
                name,
            )
            return
        armed = False
        raise Shutdown(name)

    def disarm() -> None:
        nonlocal armed
        armed = False

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield disarm
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="cluster.yaml (see examples/cluster.yaml)")
    p.add_argument("--host", default=None, help="router host (default: router.host of the config)")
    p.add_argument(
        "--port", type=int, default=None, help="router port (default: router.port of the config)"
    )
    p.add_argument(
        "--log-level",
        default="info",
        help="router and launcher log level: debug | info | warning (default info)",
    )


def main(args: argparse.Namespace) -> None:
    """Start the instances, serve the router on a thread, and watch the instances from the main
    thread until SIGTERM/SIGINT; then stop the router taking requests, drain and stop every
    instance, and return only once they are gone."""
    import uvicorn

    from tandem.cluster.launch.kv_group import join_kv_group
    from tandem.cluster.router.app import build_router
    from tandem.heap import freeze_startup_heap

    cfg = load_cluster_config(args.config)
    cfg.router.host = args.host or cfg.router.host
    cfg.router.port = args.port or cfg.router.port
    backend = make_backend(cfg)
    server = router = None
    with stop_on_signals() as stopping:
        try:
            instances = backend.start()
            kv_store = join_kv_group(cfg, instances, backend.rendezvous_host())  # noqa: F841 - lives with the group
            for inst in instances:
                log.info("instance %s (%s, %s) at %s", inst.id, inst.model, inst.kind, inst.url)
            server = uvicorn.Server(
                uvicorn.Config(
                    build_router(cfg, instances),
                    host=cfg.router.host,
                    port=cfg.router.port,
                    log_level=args.log_level,
                    timeout_graceful_shutdown=int(cfg.stop_timeout_s),
                )
            )
            freeze_startup_heap("router")
            router = threading.Thread(target=server.run, name="router")
            router.start()
            log.info("router on http://%s:%d", cfg.router.host, cfg.router.port)
            while router.is_alive():
                backend.check()
                router.join(CHECK_INTERVAL_S)
            raise SystemExit("the router stopped (see its log above)")
        except Shutdown as e:
            log.info("%s: stopping the router and every instance", e)
        finally:
            stopping()
            if server is not None:
                server.should_exit = True  # takes no new connection; streams in flight go on
            backend.stop()
            if router is not None:
                router.join(cfg.stop_timeout_s)
