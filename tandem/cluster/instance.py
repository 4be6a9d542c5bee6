"""What a serving instance tells the router, and the role it plays in its model group.

The snapshot is taken on the engine thread after each step (the `on_step` hook), so the HTTP
side never reads engine structures the loop is mutating: queue counts and KV figures every
step (O(1)); the per-request prefill backlog, the preempted requests waiting and the
cached-prefix summary at most every `full_interval` seconds, and always when the engine goes
idle, so an idle instance never reports stale load. GET /tandem/state serves the latest
snapshot as JSON whose keys are `tandem.cluster.routing.InstanceState`'s fields plus a few
extras (block size, per level).
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

from tandem.cluster.routing import ROLES
from tandem.core.instance_state import Backlog, instance_load, request_backlog

MAX_PREFIXES = 4096  # newest cached block hashes reported to the router


class RoleRequest(BaseModel):
    role: str


class InstanceSnapshot:
    """Latest engine state as a plain dict; replaced whole (one reference store), so a reader
    on another thread sees either the old or the new one, never a mix."""

    def __init__(self, engine: Any, model: str, role: str = "colocated", elastic: bool = False,
                 full_interval: float = 0.2) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.model, self.role, self.elastic = model, role, elastic
        self.full_interval = full_interval
        self._last_full = float("-inf")
        self._backlog, self._prefixes = Backlog(0, 0), []
        self.data: dict = {}
        self.update(engine)  # the loop is idle before the first request: safe to read here

    def update(self, engine: Any, *_: Any) -> None:
        """Engine-thread hook (signature of AsyncLLM.on_step)."""
        s, kv = engine.scheduler, engine.kv_manager
        now = time.monotonic()
        if now - self._last_full >= self.full_interval or not engine.has_unfinished_requests():
            self._last_full = now
            self._backlog = request_backlog(s)
            # newest first: the index keeps caching order
            self._prefixes = list(itertools.islice(reversed(kv.pool.cached_hashes), MAX_PREFIXES))
        self.data = {
            "model": self.model, "role": self.role, "elastic": self.elastic,
            **dataclasses.asdict(instance_load(s, self._backlog)),
            "max_model_len": engine.max_model_len, "cached_prefixes": self._prefixes,
        }

    def set_role(self, role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.role = role
        self.data = {**self.data, "role": role}


def add_instance_routes(app: FastAPI, snapshot: InstanceSnapshot) -> None:
    """GET /tandem/state, POST /tandem/role."""

    @app.get("/tandem/state")
    async def state():
        return snapshot.data

    @app.post("/tandem/role")
    async def role(req: RoleRequest):
        try:
            snapshot.set_role(req.role)
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        return snapshot.data
