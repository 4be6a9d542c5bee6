"""API keys: with `api_key` or `api_key_classes` configured, every route needs one of them (a
key mapped to a request class is a key too, so with only those the server is not open): /v1/*,
/tokenize, /metrics, /dashboard/data, /openapi.json, the cluster's /tandem/* routes. Open:
/health (probes) and the dashboard page with its scripts, which hold no figures and ask for the
key. A key comes as `Authorization: Bearer KEY`, or as Anthropic's clients send it,
`x-api-key: KEY`. Keys are compared in constant time, each one, whichever matches."""

from __future__ import annotations

import hmac

from fastapi import Request

from tandem.server.errors import error_response
from tandem.server.state import ServerConfig, serving_state

OPEN_PATHS = ("/health", "/dashboard")
OPEN_PREFIXES = ("/dashboard/static/",)


def key_accepted(config: ServerConfig, authorization: str | None) -> bool:
    """True without keys configured, else if the header is `Bearer K` for one of them."""
    keys = ([config.api_key] if config.api_key else []) + list(config.api_key_classes or {})
    given = (authorization or "").encode()
    matched = False
    for key in keys:  # no early exit: the time taken does not say which key came close
        matched |= hmac.compare_digest(given, f"Bearer {key}".encode())
    return matched or not keys


def presented_key(request: Request) -> str | None:
    """The request's Authorization header, or its x-api-key as one."""
    x_api_key = request.headers.get("x-api-key")
    return request.headers.get("authorization") or (f"Bearer {x_api_key}" if x_api_key else None)


async def require_api_key(request: Request, call_next):
    """HTTP middleware (`app.middleware("http")`)."""
    path = request.url.path
    if (
        path not in OPEN_PATHS
        and not path.startswith(OPEN_PREFIXES)
        and not key_accepted(serving_state(request).config, presented_key(request))
    ):
        return error_response(
            401,
            "invalid or missing API key (Authorization: Bearer KEY, or x-api-key)",
            "authentication_error",
            path=path,
        )
    return await call_next(request)
