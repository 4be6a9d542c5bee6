"""`tandem cluster up --config cluster.yaml`: start every instance (local processes, or Ray
actors), wait until each answers /health, then serve the router in this process. Ctrl-C (or
any exit) stops the instances it started."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from tandem.cluster.config import ClusterConfig, ModelGroup, load_cluster_config
from tandem.cluster.pool import Instance

log = logging.getLogger(__name__)


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
        return [sys.executable, "-m", "tandem.cluster.embedding_server", "--model", g.model,
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


class LocalBackend:
    """Each instance is a `tandem serve` (or embedding server) subprocess on a free port."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, timeout: float = 600.0) -> list[Instance]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out, urls = [], {}
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        try:
            for spec in plan(self.cfg):
                port = free_port()
                cmd = instance_command(spec, port, self.log_dir / f"{spec.id}.yaml")
                with open(self.log_dir / f"{spec.id}.log", "wb") as logf:
                    self.procs[spec.id] = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                                           env={**env, "OMP_NUM_THREADS": str(spec.num_threads)})
                urls[spec.id] = f"http://127.0.0.1:{port}"
                out.append(spec.instance(urls[spec.id]))
            wait_healthy(urls, self._exited, timeout)
        except BaseException:
            self.stop()
            raise
        return out + external_instances(self.cfg)

    def rendezvous_host(self) -> str:
        """Where instances reach a store this process serves (torch_dist KV transfer)."""
        return "127.0.0.1"

    def _exited(self, iid: str) -> str | None:
        code = self.procs[iid].poll()
        if code is None:
            return None
        tail = (self.log_dir / f"{iid}.log").read_text(errors="replace")[-2000:]
        return f"exit code {code}; log {self.log_dir / f'{iid}.log'}:\n{tail}"

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def make_backend(cfg: ClusterConfig):
    if cfg.backend == "ray":
        from tandem.cluster.ray_backend import RayBackend
        return RayBackend(cfg)
    return LocalBackend(cfg)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="cluster.yaml (see examples/cluster.yaml)")
    p.add_argument("--host", default=None, help="router host (default: router.host of the config)")
    p.add_argument("--port", type=int, default=None, help="router port (default: router.port of the config)")
    p.add_argument("--log-level", default="info")


def main(args: argparse.Namespace) -> None:
    import uvicorn

    from tandem.cluster.kv_group import join_kv_group
    from tandem.cluster.router import build_router
    cfg = load_cluster_config(args.config)
    cfg.router.host = args.host or cfg.router.host
    cfg.router.port = args.port or cfg.router.port
    backend = make_backend(cfg)
    instances = backend.start()
    try:
        kv_store = join_kv_group(cfg, instances, backend.rendezvous_host())  # noqa: F841 - lives with the group
        for inst in instances:
            log.info("instance %s (%s, %s) at %s", inst.id, inst.model, inst.kind, inst.url)
        log.info("router on http://%s:%d", cfg.router.host, cfg.router.port)
        uvicorn.run(build_router(cfg, instances), host=cfg.router.host, port=cfg.router.port,
                    log_level=args.log_level)
    finally:
        backend.stop()
