"""Elastic roles in the router: every few seconds `elastic.RoleController` looks at each
disaggregated group's polled states (or the config's time schedule) and may pick one elastic
instance to switch. A switch drains it first - the router sends it nothing new until its
requests are done - then tells it its new role, then takes it back: no request in flight is
moved or restarted."""

from __future__ import annotations

import asyncio
import datetime
import logging
import time

import httpx

from tandem.cluster.config import ClusterConfig
from tandem.cluster.policy.elastic import RoleController
from tandem.cluster.router.metrics import RouterMetrics
from tandem.cluster.router.pool import Instance, InstancePool

log = logging.getLogger(__name__)


def local_now() -> float:
    """Seconds since the epoch shifted to local time, so `% 86400` is the local time of day
    (what a P:D schedule like "4:6 at night" means)."""
    return time.time() + datetime.datetime.now().astimezone().utcoffset().total_seconds()


class RoleLoop:
    def __init__(
        self,
        cfg: ClusterConfig,
        pool: InstancePool,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
    ) -> None:
        self.rcfg, self.pool, self.client, self.metrics = cfg.router, pool, client, metrics
        self.controllers = {
            g.name: RoleController(self.rcfg.elastic, self.rcfg.elastic_schedule)
            for g in cfg.models
            if g.kind == "chat"
        }
        self.switching: set[str] = set()  # models with a switch under way

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.rcfg.elastic_interval_s)
            self.step(local_now())

    def step(self, now: float) -> None:
        pool = self.pool
        for model, ctl in self.controllers.items():
            group = pool.group(model)
            if model in self.switching or not any(i.state.elastic for i in group):
                continue
            decision = ctl.decide(now, [i.state for i in group])
            if decision is not None:
                self.switching.add(model)
                asyncio.create_task(self.switch(pool.instances[decision[0]], decision[1]))

    async def switch(self, inst: Instance, role: str) -> bool:
        """Drain, switch, undrain. False (role unchanged) if it does not drain in time or fails."""
        rc, pool = self.rcfg, self.pool
        log.info("elastic: draining %s to switch %s -> %s", inst.id, inst.state.role, role)
        inst.state.draining = True
        try:
            deadline = time.monotonic() + rc.drain_timeout_s
            while inst.inflight or inst.state.num_running or inst.state.num_waiting:
                if time.monotonic() > deadline or not inst.state.healthy:
                    log.warning(
                        "elastic: %s did not drain (healthy=%s); role unchanged",
                        inst.id,
                        inst.state.healthy,
                    )
                    return False
                await asyncio.sleep(pool.poll_interval_s / 2)
            r = await self.client.post(inst.url + "/tandem/role", json={"role": role}, timeout=5)
            r.raise_for_status()
            inst.state.role = role
            self.metrics.role_switches.labels(inst.model, role).inc()
            log.info("elastic: %s is now %s", inst.id, role)
            return True
        except httpx.HTTPError as e:
            log.warning("elastic: switching %s failed: %s", inst.id, e)
            return False
        finally:
            inst.state.draining = False
            self.switching.discard(inst.model)
