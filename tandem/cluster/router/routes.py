"""The router's HTTP routes: module-level handlers reading the `Router` (router.py) from
`app.state.router`, so each can be served and tested alone."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from tandem.cluster.router.router import Router

api = APIRouter()


class MigrateRequest(BaseModel):
    request_id: str
    to: str | None = None  # an instance id; None: the decode instance with the most free KV


def router_of(request: Request) -> Router:
    return request.app.state.router


@api.post("/v1/chat/completions")
async def chat_completions(request: Request):
    return await router_of(request).route(request, "chat")


@api.post("/v1/completions")
async def completions(request: Request):
    return await router_of(request).route(request, "chat")


@api.post("/v1/embeddings")
async def embeddings(request: Request):
    return await router_of(request).route(request, "embedding")


@api.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": router_of(request).model_cards()}


@api.get("/health")
async def health(request: Request):
    ok, body = router_of(request).health()
    return JSONResponse(body, status_code=200 if ok else 503)


@api.post("/tandem/migrate")
async def migrate(body: MigrateRequest, request: Request):
    """Operator: move a decoding P/D request (by its response `id`) to another decode instance."""
    return await router_of(request).pd.chain.migrate(body.request_id, body.to)


@api.get("/cluster/state")
async def cluster_state(request: Request):
    return router_of(request).cluster_state()


@api.get("/metrics")
async def metrics(request: Request):
    router = router_of(request)
    return Response(await router.metrics.exposition(router.client), media_type=CONTENT_TYPE_LATEST)
