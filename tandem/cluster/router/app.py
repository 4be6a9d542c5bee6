"""The cluster's one entry point: the router's FastAPI app, serving the OpenAI API of `tandem
serve` (routes.py) over a `Router` (router.py), with the poller and the background loops
running for the app's lifetime."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.cluster.config import ClusterConfig
from tandem.cluster.router.pool import Instance
from tandem.cluster.router.prefix import PromptTokenizer
from tandem.cluster.router.proxy import json_error
from tandem.cluster.router.router import Router
from tandem.cluster.router.routes import api
from tandem.server.dashboard import add_router_dashboard
from tandem.server.middleware import BodySizeLimit


async def http_error(_: Request, e: StarletteHTTPException) -> Response:
    return json_error(e.status_code, str(e.detail))


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    """Poll the instances once (route from real state from the first request on), then run the
    poller, the elastic role loop and the migration loop until shutdown."""
    router: Router = app.state.router
    await router.pool.poll_once()
    tasks = [
        asyncio.create_task(loop.run()) for loop in (router.pool, router.roles, router.migration)
    ]
    try:
        yield
    finally:
        for t in tasks:
            t.cancel()
        await router.client.aclose()


def build_router(
    cfg: ClusterConfig,
    instances: list[Instance],
    tokenizers: dict[str, PromptTokenizer] | None = None,
) -> FastAPI:
    app = FastAPI(title="Tandem router", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.router = router = Router(cfg, instances, tokenizers)
    app.include_router(api)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_middleware(BodySizeLimit, max_bytes=cfg.router.max_body_bytes)
    add_router_dashboard(app, router)
    return app
