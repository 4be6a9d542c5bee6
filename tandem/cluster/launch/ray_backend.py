"""Instances as Ray actors: each actor builds the same app `tandem serve` (or the embedding
server) runs and serves it on a free port of its node, and returns its URL; Ray places the
actors by the resources the config asks for (`num_gpus`, `num_cpus`). The router is unchanged:
it only sees URLs. Nodes need tandem installed in the same Python environment."""

from __future__ import annotations

import logging
import os
import threading
import time

from tandem.cluster.config import ClusterConfig
from tandem.cluster.launch.instances import (
    InstanceSpec,
    external_instances,
    free_port,
    instance_died,
    plan,
    wait_healthy,
)
from tandem.cluster.router.pool import Instance

log = logging.getLogger(__name__)
LOCAL = (None, "", "local")
CHECK_TIMEOUT_S = 5.0  # an actor that does not answer within this is busy, not known dead


class InstanceServer:
    """The actor's body: engine (or embedder) + app + uvicorn on a thread of the actor."""

    def __init__(self, spec: InstanceSpec, bind_host: str, url_host: str | None) -> None:
        import uvicorn

        g = spec.group
        if g.kind == "embedding":
            from tandem.cluster.launch.embedding_server import Embedder, build_embedding_app

            app, self.llm = build_embedding_app(Embedder(g.model, spec.num_threads), g.name), None
        else:
            from tandem.config import EngineConfig
            from tandem.engine.async_llm import AsyncLLM
            from tandem.server.api_server import ServerConfig, build_app

            engine = EngineConfig.from_kwargs(
                **{"model": g.model, **g.engine, "num_threads": spec.num_threads}
            )
            self.llm = AsyncLLM(engine)  # the engine core in its own process, as under tandem serve
            app = build_app(
                self.llm, ServerConfig(model_name=g.name, role=spec.role, elastic=spec.elastic)
            )
        port = free_port(bind_host)
        if url_host is None:
            import ray

            url_host = ray.util.get_node_ip_address()
        self._url = f"http://{url_host}:{port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host=bind_host, port=port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)

    def url(self) -> str:
        return self._url

    def stop(self, timeout: float) -> None:
        """Drain: take no new connection, let responses in flight finish (up to `timeout`),
        then stop the engine."""
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.llm is not None:
            self.llm.shutdown()


class RayBackend:
    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.actors: dict[str, object] = {}
        self.specs: dict[str, InstanceSpec] = {}
        self.instances: dict[str, Instance] = {}
        self.left_out: set[str] = set()  # died and not restarted
        self.started_ray = False
        self.start_timeout = 600.0

    def start(self, timeout: float = 600.0) -> list[Instance]:
        import ray

        specs = plan(self.cfg)
        local = self.cfg.ray_address in LOCAL
        if not ray.is_initialized():
            if local:  # a one-node Ray here; logical CPUs are scheduling tokens, so never too few
                need = sum(s.group.resources.get("num_cpus", 1) for s in specs)
                ray.init(
                    num_cpus=max(os.cpu_count() or 1, int(need + 0.999)),
                    include_dashboard=False,
                    log_to_driver=False,
                )
            else:
                ray.init(address=self.cfg.ray_address, log_to_driver=False)
            self.started_ray = True
        # Loopback on one node; across nodes, bind every interface and advertise the node's IP.
        self._hosts = ("127.0.0.1", "127.0.0.1") if local else ("0.0.0.0", None)
        self.start_timeout = timeout
        try:
            for spec in specs:
                self.specs[spec.id] = spec
                self.actors[spec.id] = self._actor(spec)
            urls = dict(
                zip(
                    self.actors,
                    ray.get([a.url.remote() for a in self.actors.values()], timeout=timeout),
                )
            )
            wait_healthy(urls, timeout=timeout)
        except BaseException:
            self.stop()
            raise
        self.instances = {i: self.specs[i].instance(u) for i, u in urls.items()}
        return list(self.instances.values()) + external_instances(self.cfg)

    def _actor(self, spec: InstanceSpec):
        import ray

        res = spec.group.resources
        return (
            ray.remote(InstanceServer)
            .options(
                name=None,
                num_cpus=res.get("num_cpus", 1),
                num_gpus=res.get("num_gpus", 0),
                max_restarts=0,
            )
            .remote(spec, *self._hosts)
        )

    def rendezvous_host(self) -> str:
        """Where actors reach a store this (driver) process serves: loopback on a one-node Ray
        started here, else this node's IP (the head's, when `tandem cluster up` runs there)."""
        if self.cfg.ray_address in LOCAL:
            return "127.0.0.1"
        import ray

        return ray.util.get_node_ip_address()

    def kill(self, instance_id: str) -> None:
        """Kill one instance's actor at once (fault injection)."""
        import ray

        ray.kill(self.actors[instance_id], no_restart=True)

    def check(self) -> None:
        """An actor that died is reported, then started again (a new actor, at a new URL the
        router is given) or left out."""
        import ray

        for iid, actor in list(self.actors.items()):
            if iid in self.left_out or iid not in self.instances:
                continue
            try:
                ray.get(actor.url.remote(), timeout=CHECK_TIMEOUT_S)
                continue
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayActorError as e:
                why = str(e)
            inst, spec = self.instances[iid], self.specs[iid]
            if not instance_died(inst, spec, why):
                self.left_out.add(iid)
                continue
            try:
                self.actors[iid] = self._actor(spec)
                url = ray.get(self.actors[iid].url.remote(), timeout=self.start_timeout)
                wait_healthy({iid: url}, timeout=self.start_timeout)
                inst.url = url
                log.info("instance %s is back at %s", iid, url)
            except (ray.exceptions.RayError, RuntimeError, TimeoutError) as e:
                log.error("instance %s did not come back, left out: %s", iid, e)
                self.left_out.add(iid)

    def stop(self) -> None:
        """Every actor drains at once (up to `stop_timeout_s`), then is killed."""
        import ray

        pending = [actor.stop.remote(self.cfg.stop_timeout_s) for actor in self.actors.values()]
        if pending:  # an actor already dead answers with its error: killed below either way
            ray.wait(pending, num_returns=len(pending), timeout=self.cfg.stop_timeout_s + 5)
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)
        self.actors.clear()
        if self.started_ray:
            ray.shutdown()
