"""`tandem serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn). The routes are
module-level handlers in `server/routes/`, each reading what it needs from `app.state.serving`
(`server/state.py`); this module only puts the app together."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from tandem.engine.async_llm import AsyncLLM
from tandem.engine.lora_names import LoRANames
from tandem.server.auth import require_api_key
from tandem.server.dashboard import add_server_dashboard
from tandem.server.errors import add_error_handlers
from tandem.server.instance import InstanceSnapshot, add_instance_routes
from tandem.server.metrics import ServerMetrics
from tandem.server.middleware import BodySizeLimit
from tandem.server.pd_routes import add_pd_routes
from tandem.server.precision import check_key_classes
from tandem.server.routes import (
    chat,
    completions,
    health,
    lora,
    messages,
    models,
    responses_api,
    tokenize,
)
from tandem.server.state import ServerConfig, ServingState, engine_facts

__all__ = ["ServerConfig", "build_app"]
ROUTERS = (
    completions.router,
    chat.router,
    messages.router,
    responses_api.router,
    tokenize.router,
    models.router,
    lora.router,
    health.router,
)


def build_app(llm: AsyncLLM, config: ServerConfig) -> FastAPI:
    check_key_classes(config.api_key_classes)
    app = FastAPI(title="Tandem", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(llm, config.model_name, config.request_log, config.request_log_text)
    app.state.serving = ServingState(
        llm, config, metrics, engine_facts(llm), loras=LoRANames(llm.config.lora_config)
    )
    for router in ROUTERS:
        app.include_router(router)
    add_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    app.middleware("http")(require_api_key)  # added late: runs early
    if config.allowed_origins:  # outermost: a browser's preflight carries no key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.allowed_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "x-api-key", "content-type"],
        )
    add_cluster_routes(app, llm, config, metrics)
    add_server_dashboard(app, metrics.registry, config.model_name)
    return app


def add_cluster_routes(
    app: FastAPI, llm: AsyncLLM, config: ServerConfig, metrics: ServerMetrics
) -> None:
    """The instance side of a cluster (/tandem/state, /tandem/role, the P/D routes), and the
    per-step hook that feeds the metrics."""
    llm.on_step = metrics.on_step
    add_instance_routes(
        app,
        InstanceSnapshot(
            llm,
            config.model_name,
            config.role or "colocated",
            config.elastic,
            app.state.serving.loras,
        ),
    )
    add_pd_routes(app, llm, config.model_name, in_cluster=config.role is not None)
