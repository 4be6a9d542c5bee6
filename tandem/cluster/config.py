"""`cluster.yaml`: which models run on how many instances of which role, the router's options,
and where instances run (local processes, or Ray actors). Validated up front, so a typo fails
at `tandem cluster up` and not minutes later on the first request.

```yaml
backend: local            # local | ray
ray: {address: null}      # null/"local": start a one-node Ray here; "auto" or host:port: join
stop_timeout_s: 45        # on SIGTERM/SIGINT: how long instances may drain before SIGKILL
router: {host: 127.0.0.1, port: 8000, weights: {prefix: 1.0, load: 1.0}, migration: {kv_usage: 0.9}}
kv_transfer: {connector: shm}  # shm (one host) | torch_dist (gloo / NCCL point-to-point,
                               # across hosts)
models:
  - name: smollm2-135m
    model: smollm2-135m   # alias, .gguf file or Hugging Face folder
    kind: chat            # chat | embedding
    instances: 3          # or roles: {prefill: 1, decode: 2, colocated: 0, elastic: 0}
    engine: {kv_cache_memory: 268435456}   # any engine option (tokenizer, chat_template too;
                                           # an embedding group: num_threads only)
    resources: {num_gpus: 0, num_cpus: 1}  # per instance (Ray placement)
    restart: false        # an instance that dies: false = left out (the router routes around
                          # it), true = started again (not with torch_dist: it cannot rejoin)
```
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from tandem.cluster.policy.elastic import ElasticConfig, TimeSchedule
from tandem.cluster.policy.migration import MigrationConfig
from tandem.cluster.policy.routing import RoutingWeights
from tandem.config import EngineConfig

ROLE_KEYS = ("colocated", "prefill", "decode", "elastic")
EMBEDDING_ENGINE_KEYS = {"num_threads"}  # the one engine option an embedding instance reads
ELASTIC_START = "decode"  # elastic instances start as decode and are moved by the controller
# SIGTERM/SIGINT: instances drain (finish what is in flight) this long, then get SIGKILL.
# Longer than `tandem serve --shutdown-timeout` (30 s), so a drain is not cut short.
STOP_TIMEOUT_S = 45.0


@dataclass(slots=True)
class ModelGroup:
    name: str
    model: str
    kind: str = "chat"  # chat | embedding
    roles: dict[str, int] = field(default_factory=dict)  # role -> instances
    engine: dict[str, Any] = field(default_factory=dict)
    resources: dict[str, float] = field(default_factory=dict)
    urls: list[str] = field(
        default_factory=list
    )  # instances already running elsewhere: not launched
    restart: bool = (
        False  # start an instance of this group again when it dies (else it is left out)
    )

    def instance_roles(self) -> list[tuple[str, bool]]:
        """(starting role, elastic) of each instance to launch."""
        out = []
        for key in ROLE_KEYS:
            out += [
                (ELASTIC_START if key == "elastic" else key, key == "elastic")
            ] * self.roles.get(key, 0)
        return out

    @property
    def disaggregated(self) -> bool:
        return bool(
            self.roles.get("prefill") or self.roles.get("decode") or self.roles.get("elastic")
        )


@dataclass(slots=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    weights: RoutingWeights = field(default_factory=RoutingWeights)
    poll_interval_s: float = 0.5
    poll_timeout_s: float = 1.0
    max_attempts: int = 3  # instances tried for one request before giving up
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 300.0  # longest silence from an instance mid-response
    max_body_bytes: int = 4 << 20
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    elastic_interval_s: float = 2.0
    elastic_schedule: TimeSchedule | None = (
        None  # [(local seconds since midnight, prefill instances)]
    )
    drain_timeout_s: float = 120.0
    migration: MigrationConfig = field(
        default_factory=MigrationConfig
    )  # P/D: decoding requests off short instances


@dataclass(slots=True)
class KVTransferConfig:
    """How P/D moves KV. torch_dist: every chat instance joins one torch.distributed group at
    startup; `tandem cluster up` serves its rendezvous store, which instances reach at host:port."""

    connector: str = "shm"  # shm: shared memory, one host | torch_dist: point-to-point, any hosts
    backend: str | None = None  # gloo | nccl; None: nccl where the KV cache is on a GPU, else gloo
    host: str | None = (
        None  # the store's address as instances see it; None: 127.0.0.1, or this node's IP on Ray
    )
    port: int = 0  # 0: a free port
    timeout_s: float = 120.0  # for every instance to join

    def __post_init__(self) -> None:
        if self.connector not in ("shm", "torch_dist"):
            raise ValueError(f"kv_transfer.connector: shm or torch_dist, got {self.connector!r}")
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"kv_transfer.backend: gloo or nccl, got {self.backend!r}")


@dataclass(slots=True)
class ClusterConfig:
    models: list[ModelGroup]
    router: RouterConfig = field(default_factory=RouterConfig)
    backend: str = "local"  # local | ray
    ray_address: str | None = None
    log_dir: str = "logs/cluster"
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    stop_timeout_s: float = STOP_TIMEOUT_S


def _dataclass(cls, values: dict, where: str):
    if not isinstance(values, dict):
        raise ValueError(f"{where}: a mapping of options, got {values!r}")
    known = {f.name for f in fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"{where}: unknown option(s) {', '.join(sorted(unknown))}")
    return cls(**values)


def _group(doc: dict, i: int) -> ModelGroup:
    where = f"models[{i}]"
    if not isinstance(doc, dict) or "name" not in doc:
        raise ValueError(f"{where}: a mapping with at least `name`")
    doc = dict(doc)
    doc.setdefault("model", doc["name"])
    instances, roles = doc.pop("instances", None), doc.pop("roles", None)
    if instances is not None and roles is not None:
        raise ValueError(f"{where}: give `instances` or `roles`, not both")
    roles = (
        {"colocated": 1 if instances is None and not doc.get("urls") else int(instances or 0)}
        if roles is None
        else dict(roles)
    )
    bad = set(roles) - set(ROLE_KEYS)
    if bad:
        raise ValueError(
            f"{where}.roles: unknown role(s) {', '.join(sorted(bad))}; use {', '.join(ROLE_KEYS)}"
        )
    group = _dataclass(ModelGroup, {**doc, "roles": {k: int(v) for k, v in roles.items()}}, where)
    if not isinstance(group.restart, bool):
        raise ValueError(f"{where}.restart: true or false, got {group.restart!r}")
    if group.kind not in ("chat", "embedding"):
        raise ValueError(f"{where}.kind: chat or embedding, got {group.kind!r}")
    if group.kind == "embedding" and group.disaggregated:
        raise ValueError(f"{where}: an embedding model has no prefill/decode roles")
    if group.kind == "embedding" and set(group.engine) - EMBEDDING_ENGINE_KEYS:
        bad = ", ".join(sorted(set(group.engine) - EMBEDDING_ENGINE_KEYS))
        raise ValueError(
            f"{where}.engine: {bad} cannot apply to an embedding model (its instance runs the "
            f"encoder with its own tokenizer and no chat template; it takes only num_threads)"
        )
    if group.kind == "chat":
        # fail now on a bad option
        EngineConfig.from_kwargs(**{"model": group.model, **group.engine})
        if group.engine.get("chat_template") is not None:
            from tandem.engine.tokenizer import read_chat_template

            read_chat_template(group.engine["chat_template"])  # a template that does not parse, now
    if not group.instance_roles() and not group.urls:
        raise ValueError(f"{where}: no instances")
    return group


def parse_cluster_config(doc: dict, where: str = "cluster config") -> ClusterConfig:
    if not isinstance(doc, dict) or not doc.get("models"):
        raise ValueError(f"{where}: needs a non-empty `models` list")
    models = [_group(m, i) for i, m in enumerate(doc["models"])]
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: model names must be unique, got {names}")
    r = dict(doc.get("router") or {})
    if "weights" in r:
        r["weights"] = _dataclass(RoutingWeights, r["weights"], "router.weights")
    if "elastic" in r:
        r["elastic"] = _dataclass(ElasticConfig, r["elastic"], "router.elastic")
    if "migration" in r:
        r["migration"] = _dataclass(MigrationConfig, r["migration"], "router.migration")
    if r.get("elastic_schedule"):
        r["elastic_schedule"] = TimeSchedule(
            tuple((float(t), int(n)) for t, n in r["elastic_schedule"])
        )
    router = _dataclass(RouterConfig, r, "router")
    backend = doc.get("backend", "local")
    if backend not in ("local", "ray"):
        raise ValueError(f"{where}: backend is local or ray, got {backend!r}")
    ray = doc.get("ray") or {}
    kv_transfer = _dataclass(KVTransferConfig, dict(doc.get("kv_transfer") or {}), "kv_transfer")
    unknown = set(doc) - {
        "models",
        "router",
        "backend",
        "ray",
        "log_dir",
        "kv_transfer",
        "stop_timeout_s",
    }
    if unknown:
        raise ValueError(f"{where}: unknown section(s) {', '.join(sorted(unknown))}")
    for i, m in enumerate(models):
        if m.restart and m.kind == "chat" and kv_transfer.connector == "torch_dist":
            raise ValueError(
                f"models[{i}].restart: a restarted instance cannot rejoin the torch_dist KV "
                "transfer group; use restart: false, or kv_transfer.connector: shm"
            )
    stop = doc.get("stop_timeout_s", STOP_TIMEOUT_S)
    if isinstance(stop, bool) or not isinstance(stop, (int, float)) or stop <= 0:
        raise ValueError(f"{where}: stop_timeout_s is a number of seconds > 0, got {stop!r}")
    return ClusterConfig(
        models,
        router,
        backend,
        ray.get("address"),
        doc.get("log_dir", "logs/cluster"),
        kv_transfer,
        float(stop),
    )


def load_cluster_config(path: str | Path) -> ClusterConfig:
    try:
        doc = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read cluster config {path}: {e}") from e
    return parse_cluster_config(doc, str(path))
