"""The router's state and its one routing decision: a request goes, by its `model`, to that
model's instances; among them, by prefix-cache affinity and load (`routing.choose_instance`),
or prefill + decode for a disaggregated group (`pd.py`). Instances are polled for state;
failures are retried elsewhere (`proxy.py`); /metrics aggregates the whole cluster. Background
loops switch elastic roles (`roles.py`) and move decoding requests off decode instances short
of KV (`migrate_loop.py`). Each part is given only the collaborators it uses."""

from __future__ import annotations

import asyncio
import json

import httpx
from fastapi import Request
from fastapi.responses import Response

from tandem.cluster.config import ClusterConfig, ModelGroup
from tandem.cluster.router.metrics import RouterMetrics
from tandem.cluster.router.migrate_loop import MigrationLoop
from tandem.cluster.router.pd import PDHandoff
from tandem.cluster.router.pool import Instance, InstancePool
from tandem.cluster.router.prefix import PromptTokenizer, prefix_hashes
from tandem.cluster.router.proxy import Proxy, json_error
from tandem.cluster.router.roles import RoleLoop
from tandem.server.precision import split_model


class Router:
    """State shared by the routes: instances, their poller, the HTTP client, metrics."""

    def __init__(
        self,
        cfg: ClusterConfig,
        instances: list[Instance],
        tokenizers: dict[str, PromptTokenizer] | None = None,
    ) -> None:
        self.cfg, self.rcfg = cfg, cfg.router
        self.groups: dict[str, ModelGroup] = {g.name: g for g in cfg.models}
        self.tokenizers = tokenizers if tokenizers is not None else {}
        timeout = httpx.Timeout(self.rcfg.request_timeout_s, connect=self.rcfg.connect_timeout_s)
        self.client = httpx.AsyncClient(
            timeout=timeout,
            trust_env=False,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self.pool = InstancePool(
            instances,
            self.rcfg.weights,
            self.client,
            self.rcfg.poll_interval_s,
            self.rcfg.poll_timeout_s,
        )
        self.metrics = RouterMetrics(self.pool)
        self.proxy = Proxy(self.pool, self.client, self.metrics)
        # These act only on groups whose instances report prefill/decode (or elastic) roles.
        self.pd = PDHandoff(self.rcfg, self.pool, self.client, self.metrics, self.proxy)
        self.roles = RoleLoop(cfg, self.pool, self.client, self.metrics)
        self.migration = MigrationLoop(self.rcfg.migration, self.pd.chain, self.pool)

    def default_model(self, kind: str) -> str | None:
        return next((g.name for g in self.groups.values() if g.kind == kind), None)

    def tokenizer(self, model: str) -> PromptTokenizer:
        if model not in self.tokenizers:  # loaded once, on first use (cheap after that)
            group = self.groups[model]
            self.tokenizers[model] = (
                PromptTokenizer(group.model, group.engine)
                if group.kind == "chat"
                else PromptTokenizer(None)
            )
        return self.tokenizers[model]

    def resolve(self, model: object) -> tuple[ModelGroup | None, str | None]:
        """The group a request's `model` names, and its precision suffix: `smollm2-135m:int4` is
        group `smollm2-135m` with suffix int4 (passed on as it is: the instance checks it). A
        group whose own name has a colon is matched whole first."""
        if not isinstance(model, str):
            return None, None
        base, suffix = split_model(model, tuple(self.groups))
        return self.groups.get(base), suffix or None

    async def route(self, request: Request, kind: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except (
            ValueError,
            RecursionError,
        ) as e:  # RecursionError: nested deeper than the parser goes
            return json_error(400, f"body: invalid JSON ({e})")
        asked = body.get("model") or self.default_model(kind)
        group, suffix = self.resolve(asked)
        lora = None
        if group is None and isinstance(asked, str) and (base := self.pool.lora_group(asked)):
            group, lora = self.groups.get(base), asked  # an adapter: its instances only
        if group is None:
            self.metrics.failures.labels(
                "", "unknown_model"
            ).inc()  # not the client's text: one series
            return json_error(
                404,
                f"The model `{asked}` does not exist; this cluster serves "
                f"{', '.join(f'`{m}`' for m in self.groups)}.",
            )
        model = group.name
        if group.kind != kind:
            return json_error(
                400,
                f"model `{model}` is a {group.kind} model; it does not serve {request.url.path}",
            )
        if suffix is not None and kind != "chat":
            return json_error(
                400,
                f"model `{asked}`: a precision suffix applies to chat models; `{model}` is "
                f"an {group.kind} model",
                "invalid_request_error",
            )
        path = request.url.path
        stream = bool(body.get("stream")) and kind == "chat"
        ids = (
            await asyncio.to_thread(self.tokenizer(model).token_ids, path, body)
            if kind == "chat"
            else None
        )
        group_insts = self.pool.group(model)
        block_size = next((i.block_size for i in group_insts if i.block_size), 0)
        default = next((i.precision for i in group_insts if i.precision), None)
        precision = body.get("precision") if isinstance(body.get("precision"), str) else suffix
        salt = (
            precision if precision not in (None, default) else None
        )  # the instance's cache namespace
        # an adapter's KV is keyed by its id on the instance: no prefix affinity for it
        hashes = prefix_hashes(ids, block_size, salt) if ids and block_size and not lora else []
        num_tokens = len(ids) if ids else len(raw) // 4  # a rough token count when not tokenized
        self.metrics.requests.labels(model, path.removeprefix("/v1/")).inc()
        # a variant, or an adapter, is served whole by one instance
        if suffix is None and lora is None and self.pd.applies(model):
            return await self.pd.handle(model, path, body, stream, ids, hashes)
        return await self.proxy.forward(
            model, path, raw, stream, hashes, num_tokens, self.rcfg.max_attempts, lora=lora
        )

    def model_cards(self) -> list[dict]:
        """Every group, and each chat group's precision variants as a single server lists them
        (`name:precision`, from what its instances report) when it serves more than one."""
        cards = []
        for g in self.groups.values():
            card = {"object": "model", "created": 0, "owned_by": "tandem", "kind": g.kind}
            insts = self.pool.group(g.name)
            default = next((i.precision for i in insts if i.precision), None)
            served = next((i.precisions for i in insts if i.precisions), ())
            cards.append({"id": g.name, **card, **({"precision": default} if default else {})})
            if len(served) > 1:
                cards += [
                    {"id": f"{g.name}:{p}", **card, "root": g.name, "precision": p} for p in served
                ]
            loras = sorted({name for i in insts for name in i.loras})
            cards += [{"id": name, **card, "parent": g.name} for name in loras]
        return cards

    def cluster_state(self) -> dict:
        return {
            i.id: {
                "url": i.url,
                "model": i.model,
                "kind": i.kind,
                "healthy": i.state.healthy,
                "draining": i.state.draining,
                "role": i.state.role,
                "elastic": i.state.elastic,
                "inflight": i.inflight,
                "num_running": i.state.num_running,
                "num_waiting": i.state.num_waiting,
                "num_preempted": i.state.num_preempted,
                "kv_usage": i.state.kv_usage,
                "cached_prefixes": len(i.state.cached_prefixes),
                "last_error": i.last_error,
            }
            for i in self.pool.instances.values()
        }

    def health(self) -> tuple[bool, dict]:
        models = {m: sum(i.state.available for i in self.pool.group(m)) for m in self.groups}
        return all(models.values()), {
            "status": "ok" if all(models.values()) else "degraded",
            "available_instances": models,
        }
