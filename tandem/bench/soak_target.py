"""What `tandem bench soak` runs against: a `tandem serve` it starts with a small KV pool, a
P/D cluster it starts (`tandem cluster up`) whose decode instance it kills halfway (the
launcher starts it again), or a server on loopback (--url). Each gives its URL, the process
ids whose RSS, FDs and threads are watched (children included), and its fault."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import yaml

from tandem.cluster.launch.instances import free_port, wait_healthy
from tandem.config.args import add_engine_arguments


@dataclass
class Target:
    url: str
    pids: list[int]
    proc: subprocess.Popen | None = None
    cluster: bool = False
    faults: list[str] = field(default_factory=list)

    def fault(self) -> bool:
        """On a cluster: SIGKILL one decode instance (its API process; its engine core dies with
        it). Elsewhere: none (recorded, so it runs once). Whether one was killed."""
        if not self.cluster:
            self.faults.append("none")
            return False
        import psutil

        serves = [
            c
            for c in psutil.Process(self.proc.pid).children()
            if "serve" in c.cmdline() and "decode" in c.cmdline()
        ]
        if not serves:
            self.faults.append("no decode instance found to kill")
            return False
        os.kill(serves[0].pid, signal.SIGKILL)
        self.faults.append(
            f"killed decode instance pid {serves[0].pid} at {time.strftime('%H:%M:%S')}"
        )
        return True

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)  # drains, then stops every instance
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start_target(args: argparse.Namespace) -> Target:
    if args.url:
        url = args.url.rstrip("/")
        if urlparse(url).hostname not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"bench soak only targets loopback, not {url}")
        return Target(url, list(args.pid))
    port = free_port()
    if args.cluster:
        cmd = [
            sys.executable,
            "-m",
            "tandem.cli",
            "cluster",
            "up",
            "--config",
            cluster_config(args, port),
            "--log-level",
            "warning",
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "tandem.cli",
            "serve",
            "--model",
            args.model,
            "--port",
            str(port),
            "--log-level",
            "warning",
            *(
                x
                for flag, value in (
                    ("--kv-cache-memory", args.kv_cache_memory),
                    ("--max-model-len", args.max_model_len),
                )
                if value is not None  # not set: the engine's default
                for x in (flag, str(value))
            ),
            *args.serve_args,
        ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(
            {"target": url}, lambda _: None if proc.poll() is None else f"exited {proc.returncode}"
        )
    except BaseException:
        proc.kill()
        raise
    return Target(url, [proc.pid], proc, cluster=bool(args.cluster))


def cluster_config(args: argparse.Namespace, port: int) -> str:
    """The cluster YAML with the router on `port` on loopback and each model's KV pool at
    --kv-cache-memory (small, so requests are preempted), written to a temp file."""
    cfg = yaml.safe_load(Path(args.cluster).read_text())
    cfg.setdefault("router", {}).update(host="127.0.0.1", port=port)
    for model in cfg.get("models", []):
        model.setdefault("engine", {})["kv_cache_memory"] = args.kv_cache_memory
        model["restart"] = True
    path = Path(tempfile.mkdtemp(prefix="tandem-soak-")) / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url", default=None, help="a running server on loopback (default: start one of --model)"
    )
    p.add_argument(
        "--pid",
        type=int,
        action="append",
        default=[],
        help="with --url: the server's process id(s), for RSS / FDs / threads (children included)",
    )
    p.add_argument(
        "--cluster",
        default=None,
        help="start `tandem cluster up` of this YAML (P/D: examples/cluster-pd.yaml) instead, "
        "and kill one decode instance halfway (the launcher restarts it)",
    )
    # Of each instance started: a small KV pool, so that requests are preempted.
    add_engine_arguments(
        p,
        ("model", "kv_cache_memory", "max_model_len"),
        store_defaults=True,
        defaults={"kv_cache_memory": 24 << 20, "max_model_len": 512},
    )
    p.add_argument(
        "--serve-arg",
        dest="serve_args",
        action="append",
        default=[],
        help="a further flag for the server started (repeat)",
    )
