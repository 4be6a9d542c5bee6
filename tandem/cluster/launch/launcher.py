"""`tandem cluster up --config cluster.yaml`: start every instance (local processes, or Ray
actors), wait until each answers /health, then serve the router in this process. An instance
that dies is reported and restarted or left out (its group's `restart`). SIGTERM or SIGINT
(or any exit) drains and stops every instance it started, and it exits once they are gone."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from tandem.cluster.config import ClusterConfig, ModelGroup, load_cluster_config
from tandem.cluster.router.pool import Instance

log = logging.getLogger(__name__)
CHECK_INTERVAL_S = 0.5  # how often the instances are checked for one that died


@dataclass(slots=True)
class InstanceSpec:
    """One instance to start: which model group, which role, how many CPU threads."""

    id: str
    group: ModelGroup
    role: str
    elastic: bool
    num_threads: int

    def instance(self, url: str) -> Instance:
        return Instance(self.id, url, self.group.name, self.group.kind)


def plan(cfg: ClusterConfig) -> list[InstanceSpec]:
    """Every instance to launch; CPU threads split evenly unless the group sets num_threads."""
    todo = [(g, role, elastic) for g in cfg.models for role, elastic in g.instance_roles()]
    threads = max(1, (os.cpu_count() or 1) // max(len(todo), 1))
    counts: dict[str, int] = {}
    out = []
    for g, role, elastic in todo:
        n = counts[g.name] = counts.get(g.name, -1) + 1
        out.append(InstanceSpec(f"{g.name}-{n}", g, role, elastic, int(g.engine.get("num_threads") or threads)))
    return out


def external_instances(cfg: ClusterConfig) -> list[Instance]:
    """Instances a config names by URL (already running; the router only routes to them)."""
    return [Instance(f"{g.name}-url{i}", url.rstrip("/"), g.name, g.kind) for g in cfg.models
            for i, url in enumerate(g.urls)]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def instance_command(spec: InstanceSpec, port: int, config_file: Path) -> list[str]:
    g = spec.group
    if g.kind == "embedding":
        return [sys.executable, "-m", "tandem.cluster.launch.embedding_server", "--model", g.model,
                "--served-model-name", g.name, "--port", str(port), "--num-threads", str(spec.num_threads),
                "--log-level", "warning"]
    config_file.write_text(yaml.safe_dump({"serving": {"engine": {**g.engine, "num_threads": spec.num_threads}}}))
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--config", str(config_file), "--model", g.model,
           "--served-model-name", g.name, "--port", str(port), "--role", spec.role, "--log-level", "warning"]
    return cmd + (["--elastic"] if spec.elastic else [])


def wait_healthy(urls: dict[str, str], alive=lambda _id: None, timeout: float = 600.0) -> None:
    """Block until every URL's /health answers 200. `alive(id)` returns an error text for an
    instance that can no longer come up (its process exited), which fails at once."""
    deadline, waiting = time.monotonic() + timeout, dict(urls)
    while waiting:
        for iid, url in list(waiting.items()):
            dead = alive(iid)
            if dead:
                raise RuntimeError(f"instance {iid} failed to start: {dead}")
            try:
                if httpx.get(url + "/health", timeout=1.0, trust_env=False).status_code == 200:
                    del waiting[iid]
            except httpx.HTTPError:
                pass
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(f"instances not healthy after {timeout:.0f}s: {', '.join(waiting)}")
        time.sleep(0.2)


def instance_died(inst: Instance, spec: InstanceSpec, why: str) -> bool:
    """Report an instance that died and take it out of routing at once (the router's poll
    would find out within poll_interval_s); True when its group says to start it again."""
    head, _, rest = why.partition("\n")
    inst.state = dataclasses.replace(inst.state, healthy=False)
    inst.last_error = f"died: {head}"
    action = "restarting it (restart: true)" if spec.group.restart else "left out (restart: false)"
    log.error("instance %s (%s) died: %s; %s%s", inst.id, spec.group.name, head, action, "\n" + rest if rest else "")
    return spec.group.restart


def make_backend(cfg: ClusterConfig):
    if cfg.backend == "ray":
        from tandem.cluster.launch.ray_backend import RayBackend
        return RayBackend(cfg)
    from tandem.cluster.launch.local_backend import LocalBackend
    return LocalBackend(cfg)


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
            log.warning("%s: already stopping (instances still running get SIGKILL after stop_timeout_s)", name)
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
    p.add_argument("--port", type=int, default=None, help="router port (default: router.port of the config)")
    p.add_argument("--log-level", default="info", help="router and launcher log level: debug | info | warning (default info)")


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
            server = uvicorn.Server(uvicorn.Config(
                build_router(cfg, instances), host=cfg.router.host, port=cfg.router.port, log_level=args.log_level,
                timeout_graceful_shutdown=int(cfg.stop_timeout_s)))
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
