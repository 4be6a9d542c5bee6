"""GET /health (503 once the engine loop is gone) and GET /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tandem.server.errors import error_response
from tandem.server.state import serving_state

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    if not serving_state(request).llm.alive:
        return error_response(503, "engine loop is not running", "server_error")
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request):
    return Response(
        generate_latest(serving_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST
    )
