"""The router's Prometheus metrics, and one aggregated /metrics page for the whole cluster.

Each instance's families are parsed and re-emitted once, merged by name, every sample
labelled with `instance`: a valid exposition (no family repeated) that a Prometheus user
can sum or split by instance as usual; `_created` pseudo-gauges are dropped."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram, Metric, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from tandem.cluster.router.pool import InstancePool


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return self.families


class _PoolCollector:
    """Instance health, role, in-flight sends and draining, read at scrape time."""

    def __init__(self, pool: InstancePool) -> None:
        self.pool = pool

    def collect(self):
        labels = ["model_name", "instance", "role"]
        for name, doc, get in [
            (
                "tandem_router:instance_healthy",
                "1 if the instance's last state poll succeeded.",
                lambda i: i.state.healthy,
            ),
            (
                "tandem_router:instance_draining",
                "1 while the instance drains for a role switch.",
                lambda i: i.state.draining,
            ),
            (
                "tandem_router:instance_inflight",
                "Requests the router has open on the instance.",
                lambda i: i.inflight,
            ),
            (
                "tandem_router:instance_kv_usage",
                "KV usage the instance last reported (0-1).",
                lambda i: i.state.kv_usage,
            ),
        ]:
            g = GaugeMetricFamily(name, doc, labels=labels)
            for i in self.pool.instances.values():
                g.add_metric(
                    [i.model, i.id, i.state.role if i.kind == "chat" else i.kind], float(get(i))
                )
            yield g


class RouterMetrics:
    def __init__(self, pool: InstancePool) -> None:
        self.pool = pool
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "tandem_router:requests",
            "Requests the router took, by model and endpoint "
            "(once each, however many instances it tried).",
            ["model_name", "endpoint"],
            registry=r,
        )
        self.routed = Counter(
            "tandem_router:requests_routed",
            "Requests sent to an instance (each attempt).",
            ["model_name", "instance"],
            registry=r,
        )
        self.retries = Counter(
            "tandem_router:retries",
            "Requests retried on another instance, by cause.",
            ["model_name", "reason"],
            registry=r,
        )
        self.failures = Counter(
            "tandem_router:failures",
            "Requests the router answered with an error, by kind.",
            ["model_name", "kind"],
            registry=r,
        )
        self.role_switches = Counter(
            "tandem_router:role_switches",
            "Elastic role switches completed.",
            ["model_name", "role"],
            registry=r,
        )
        self.migrations = Counter(
            "tandem_router:migrations",
            "Decoding requests moved off a decode instance, "
            "by trigger (operator: POST /tandem/migrate; kv_short: the router's policy).",
            ["model_name", "instance", "reason"],
            registry=r,
        )
        self.kv_bytes = Counter(
            "tandem_router:kv_transfer_bytes",
            "KV bytes moved prefill -> decode (and by migrations).",
            ["model_name"],
            registry=r,
        )
        self.kv_seconds = Histogram(
            "tandem_router:kv_transfer_seconds",
            "Time of one P/D KV handoff.",
            ["model_name"],
            registry=r,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        r.register(_PoolCollector(pool))

    async def exposition(self, client: httpx.AsyncClient, timeout: float = 2.0) -> bytes:
        """The router's metrics followed by every reachable instance's, merged by family."""
        insts = list(self.pool.instances.values())
        texts = await asyncio.gather(*(_fetch(client, i.url + "/metrics", timeout) for i in insts))
        merged: dict[str, Metric] = {}
        for inst, text in zip(insts, texts):
            if text is None:
                continue
            for fam in text_string_to_metric_families(text):
                if fam.name.endswith("_created") and fam.type == "gauge":
                    continue
                out = merged.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
                if out.type != fam.type:
                    continue
                for s in fam.samples:
                    out.add_sample(s.name, {**s.labels, "instance": inst.id}, s.value)
        instances = CollectorRegistry()
        instances.register(_Families(list(merged.values())))
        return generate_latest(self.registry) + generate_latest(instances)


async def _fetch(client: httpx.AsyncClient, url: str, timeout: float) -> str | None:
    try:
        r = await client.get(url, timeout=timeout)
        return r.text if r.status_code == 200 else None
    except httpx.HTTPError:
        return None
