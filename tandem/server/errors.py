"""OpenAI-shaped errors (Anthropic-shaped under /v1/messages): `APIError` raised by handlers,
and the app's exception handlers that turn it, a body that fails validation and Starlette's own
HTTP errors into one error body."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.server import anthropic_protocol, protocol, responses_protocol


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        headers: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = (
            status,
            message,
            type_,
            param,
            headers,
        )


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    headers: dict | None = None,
    path: str = "",
) -> JSONResponse:
    """The error body the API at `path` gives: OpenAI's, or Anthropic's under /v1/messages."""
    if path.startswith(ANTHROPIC_PATHS):
        body = {"type": "error", "error": {"type": type_, "message": message}}
    else:
        body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


ANTHROPIC_PATHS = ("/v1/messages",)


async def api_error(request: Request, e: APIError) -> JSONResponse:
    return error_response(e.status, e.message, e.type, e.param, e.headers, request.url.path)


async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    path = request.url.path
    # the deepest: of a union's branches, the one that came closest names the problem
    first = max(e.errors(), key=lambda err: len(err.get("loc", ())), default={})
    where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
    if first.get("type") == "extra_forbidden":
        api = (
            anthropic_protocol
            if path.startswith(ANTHROPIC_PATHS)
            else responses_protocol
            if path.startswith("/v1/responses")
            else protocol
        )
        refused = api.REFUSED
        why = refused.get(where or "", "this server does not implement it")
        return error_response(
            400,
            f"unsupported field `{where}`: {why} (a field this server "
            "cannot honour is refused, not ignored: docs/api_fields.md)",
            param=where,
            path=path,
        )
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    return error_response(400, f"{where or 'body'}: {message}", param=where, path=path)


async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    return error_response(
        e.status_code,
        str(e.detail),
        "not_found_error" if e.status_code == 404 else "invalid_request_error",
        path=request.url.path,
    )


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
