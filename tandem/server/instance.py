"""What a serving instance tells the router, and the role it plays in its model group.

The load report is computed in the engine-core process with each step (engine/core_stats.py)
and arrives with the step's outputs, so the HTTP side never reads engine structures. GET
/tandem/state serves the latest one as JSON whose keys are
`tandem.cluster.policy.routing.InstanceState`'s fields plus a few extras (block size, per
level), with this instance's model, role, elastic flag, precision variants (default, then
every one a request may name) and LoRA adapters; POST /tandem/role sets the role.
"""

from __future__ import annotations

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

from tandem.config import InstanceRole
from tandem.engine.async_llm import AsyncLLM
from tandem.engine.lora_names import LoRANames


class RoleRequest(BaseModel):
    role: str


class InstanceSnapshot:
    def __init__(
        self,
        llm: AsyncLLM,
        model: str,
        role: InstanceRole = InstanceRole.COLOCATED,
        elastic: bool = False,
        loras: LoRANames | None = None,
    ) -> None:
        self.llm, self.model, self.elastic, self.loras = llm, model, elastic, loras
        self.set_role(role)

    @property
    def data(self) -> dict:
        p = self.llm.precisions
        return {
            "model": self.model,
            "role": self.role,
            "elastic": self.elastic,
            "precision": p.default,
            "precisions": p.served,
            "loras": sorted(self.loras.loras) if self.loras else [],
            **self.llm.stats.instance,
        }

    def set_role(self, role: str) -> None:
        self.role = InstanceRole.parse(role, "role")


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
