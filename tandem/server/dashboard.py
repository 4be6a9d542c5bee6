"""GET /dashboard: one live page for `tandem serve` and for the router, with no build step and
no CDN (uPlot, MIT, vendored under static/vendor with its licence). The page polls
/dashboard/data every 1.5 s; that endpoint takes a sample of the process's own Prometheus
exposition (dashboard_data.py) and, on the router, adds every instance's role, load and KV.
With API keys the data needs `Authorization: Bearer KEY`, as every route does on `tandem serve`
(server/auth.py; the page asks for the key and shows nothing without it); the page and its
scripts hold no figures and are served openly."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from prometheus_client import generate_latest

from tandem.server.dashboard_data import DashboardSeries

STATIC = Path(__file__).resolve().parent / "static"
FILES = {
    "dashboard.js": "dashboard.js",
    "dashboard.css": "dashboard.css",
    "uPlot.iife.min.js": "vendor/uPlot.iife.min.js",
    "uPlot.min.css": "vendor/uPlot.min.css",
}


router = APIRouter()


@dataclass(slots=True)
class Dashboard:
    """One app's page and samples, on `app.state.dashboard`. kind: "server" or "router" (the
    router's page adds the instances and the P/D transfers)."""

    kind: str
    title: str
    exposition: Callable[[], Awaitable[str]]
    instances: Callable[[], dict] | None = None
    series: DashboardSeries = field(default_factory=DashboardSeries)


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard(request: Request):
    d: Dashboard = request.app.state.dashboard
    return _page().replace("{{TITLE}}", d.title).replace("{{KIND}}", d.kind)


@router.get("/dashboard/static/{name}")
async def static(name: str):
    if name not in FILES:
        return JSONResponse({"error": {"message": f"no file {name}"}}, status_code=404)
    return FileResponse(STATIC / FILES[name])


@router.get("/dashboard/data")
async def data(request: Request):
    d: Dashboard = request.app.state.dashboard
    point = d.series.add(await d.exposition())
    return {
        "kind": d.kind,
        "title": d.title,
        "now": point,
        "series": d.series.series(),
        "instances": d.instances() if d.instances else None,
    }


@functools.cache
def _page() -> str:
    return (STATIC / "dashboard.html").read_text()


def add_server_dashboard(app: FastAPI, registry, model: str) -> None:
    async def exposition() -> str:
        return generate_latest(registry).decode()

    app.state.dashboard = Dashboard("server", f"tandem serve: {model}", exposition)
    app.include_router(router)


def add_router_dashboard(app: FastAPI, cluster) -> None:
    """cluster: the `Router` (cluster/router/router.py)."""

    async def exposition() -> str:
        return (await cluster.metrics.exposition(cluster.client)).decode()

    app.state.dashboard = Dashboard(
        "router",
        "tandem router: " + ", ".join(cluster.groups),
        exposition,
        instances=cluster.cluster_state,
    )
    app.include_router(router)
