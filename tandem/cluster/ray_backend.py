"""Instances as Ray actors: each actor builds the same app `tandem serve` (or the embedding
server) runs and serves it on a free port of its node, and returns its URL; Ray places the
actors by the resources the config asks for (`num_gpus`, `num_cpus`). The router is unchanged:
it only sees URLs. Nodes need tandem installed in the same Python environment."""
from __future__ import annotations

import os
import threading
import time

from tandem.cluster.config import ClusterConfig
from tandem.cluster.launcher import InstanceSpec, external_instances, free_port, plan, wait_healthy
from tandem.cluster.pool import Instance

LOCAL = (None, "", "local")


class InstanceServer:
    """The actor's body: engine (or embedder) + app + uvicorn on a thread of the actor."""

    def __init__(self, spec: InstanceSpec, bind_host: str, url_host: str | None) -> None:
        import uvicorn
        g = spec.group
        if g.kind == "embedding":
            from tandem.cluster.embedding_server import Embedder, build_embedding_app
            app, self.llm = build_embedding_app(Embedder(g.model, spec.num_threads), g.name), None
        else:
            from tandem.config import EngineConfig
            from tandem.engine.async_llm import AsyncLLM
            from tandem.server.api_server import ServerConfig, build_app
            engine = EngineConfig.from_dict({"model": g.model, **g.engine, "num_threads": spec.num_threads})
            self.llm = AsyncLLM(engine)  # the engine core in its own process, as under tandem serve
            app = build_app(self.llm, ServerConfig(model_name=g.name, role=spec.role, elastic=spec.elastic))
        port = free_port(bind_host)
        if url_host is None:
            import ray
            url_host = ray.util.get_node_ip_address()
        self._url = f"http://{url_host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=bind_host, port=port, log_level="warning"))
        threading.Thread(target=self.server.run, daemon=True).start()
        deadline = time.monotonic() + 60
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)

    def url(self) -> str:
        return self._url

    def stop(self) -> None:
        self.server.should_exit = True
        if self.llm is not None:
            self.llm.shutdown()


class RayBackend:
    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.actors: dict[str, object] = {}
        self.started_ray = False

    def start(self, timeout: float = 600.0) -> list[Instance]:
        import ray
        specs = plan(self.cfg)
        local = self.cfg.ray_address in LOCAL
        if not ray.is_initialized():
            if local:  # a one-node Ray here; logical CPUs are scheduling tokens, so never too few
                need = sum(s.group.resources.get("num_cpus", 1) for s in specs)
                ray.init(num_cpus=max(os.cpu_count() or 1, int(need + 0.999)), include_dashboard=False,
                         log_to_driver=False)
            else:
                ray.init(address=self.cfg.ray_address, log_to_driver=False)
            self.started_ray = True
        # Loopback on one node; across nodes, bind every interface and advertise the node's IP.
        bind, url_host = ("127.0.0.1", "127.0.0.1") if local else ("0.0.0.0", None)
        cls = ray.remote(InstanceServer)
        try:
            for spec in specs:
                res = spec.group.resources
                self.actors[spec.id] = cls.options(
                    name=None, num_cpus=res.get("num_cpus", 1), num_gpus=res.get("num_gpus", 0),
                    max_restarts=0).remote(spec, bind, url_host)
            urls = dict(zip(self.actors, ray.get([a.url.remote() for a in self.actors.values()], timeout=timeout)))
            wait_healthy(urls, timeout=timeout)
        except BaseException:
            self.stop()
            raise
        by_id = {s.id: s for s in specs}
        return [by_id[i].instance(u) for i, u in urls.items()] + external_instances(self.cfg)

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

    def stop(self) -> None:
        import ray
        for actor in self.actors.values():
            try:
                ray.get(actor.stop.remote(), timeout=10)
            except Exception:  # already dead or unreachable: kill below either way
                pass
            ray.kill(actor, no_restart=True)
        self.actors.clear()
        if self.started_ray:
            ray.shutdown()
