"""API keys: with `api_key` or `api_key_classes` configured, every /v1/ route needs one of them
(a key mapped to a request class is a key too, so with only those the server is not open)."""
from __future__ import annotations

from fastapi import Request

from tandem.server.errors import error_response
from tandem.server.precision import key_priority
from tandem.server.state import serving_state


async def require_api_key(request: Request, call_next):
    """HTTP middleware (`app.middleware("http")`)."""
    config = serving_state(request).config
    if (config.api_key or config.api_key_classes) and request.url.path.startswith("/v1/"):
        auth = request.headers.get("authorization")
        if (not config.api_key or auth != f"Bearer {config.api_key}") \
                and key_priority(auth, config.api_key_classes) is None:
            return error_response(401, "invalid or missing API key", "authentication_error")
    return await call_next(request)
