"""The instances a cluster.yaml asks for, and what every launch backend (local processes, Ray
actors) does with one: plan them, find a free port, wait until each answers /health, and
report one that died."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from dataclasses import dataclass

import httpx

from tandem.cluster.config import ClusterConfig, ModelGroup
from tandem.cluster.router.pool import Instance

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
        out.append(
            InstanceSpec(
                f"{g.name}-{n}", g, role, elastic, int(g.engine.get("num_threads") or threads)
            )
        )
    return out


def external_instances(cfg: ClusterConfig) -> list[Instance]:
    """Instances a config names by URL (already running; the router only routes to them)."""
    return [
        Instance(f"{g.name}-url{i}", url.rstrip("/"), g.name, g.kind)
        for g in cfg.models
        for i, url in enumerate(g.urls)
    ]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
    log.error(
        "instance %s (%s) died: %s; %s%s",
        inst.id,
        spec.group.name,
        head,
        action,
        "\n" + rest if rest else "",
    )
    return spec.group.restart
