"""GET /dashboard: one live page for `tandem serve` and for the router, with no build step and
no CDN (uPlot, MIT, vendored under static/vendor with its licence). The page polls
/dashboard/data every 1.5 s; that endpoint takes a sample of the process's own Prometheus
exposition (dashboard_data.py) and, on the router, adds every instance's role, load and KV.
With an API key the data needs `Authorization: Bearer KEY` (the page asks for the key and
shows nothing without it); the page and its scripts hold no figures and are served openly."""
from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from prometheus_client import generate_latest

from tandem.server.dashboard_data import DashboardSeries

STATIC = Path(__file__).resolve().parent / "static"
FILES = {"dashboard.js": "dashboard.js", "dashboard.css": "dashboard.css",
         "uPlot.iife.min.js": "vendor/uPlot.iife.min.js", "uPlot.min.css": "vendor/uPlot.min.css"}


def add_dashboard_routes(app: FastAPI, kind: str, title: str, exposition: Callable[[], Awaitable[str]],
                         api_key: str | None = None, instances: Callable[[], dict] | None = None) -> None:
    """kind: "server" or "router" (the router's page adds the instances and the P/D transfers)."""
    series = DashboardSeries()
    page = (STATIC / "dashboard.html").read_text().replace("{{TITLE}}", title).replace("{{KIND}}", kind)

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard():
        return page

    @app.get("/dashboard/static/{name}")
    async def static(name: str):
        if name not in FILES:
            return JSONResponse({"error": {"message": f"no file {name}"}}, status_code=404)
        return FileResponse(STATIC / FILES[name])

    @app.get("/dashboard/data")
    async def data(request: Request):
        if api_key and not hmac.compare_digest(request.headers.get("authorization", ""), f"Bearer {api_key}"):
            return JSONResponse({"error": {"message": "this server needs its API key (Authorization: Bearer KEY)",
                                           "type": "invalid_api_key", "code": 401}}, status_code=401)
        point = series.add(await exposition())
        return {"kind": kind, "title": title, "now": point, "series": series.series(),
                "instances": instances() if instances else None}


def add_server_dashboard(app: FastAPI, registry, api_key: str | None, model: str) -> None:
    async def exposition() -> str:
        return generate_latest(registry).decode()
    add_dashboard_routes(app, "server", f"tandem serve: {model}", exposition, api_key)


def add_router_dashboard(app: FastAPI, router) -> None:
    async def exposition() -> str:
        return (await router.metrics.exposition(router.client)).decode()
    add_dashboard_routes(app, "router", "tandem router: " + ", ".join(router.groups), exposition,
                         instances=router.cluster_state)
