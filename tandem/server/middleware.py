"""Pure ASGI middleware: refuse request bodies over a size limit (413) while they are read, so
a body without a content-length (chunked) is counted too and never buffered past the limit; the
connection is closed with the answer, so the rest is not read either."""

from __future__ import annotations

import json


class BodySizeLimit:
    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._reject(send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await self._reject(send)

    async def _reject(self, send) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": f"request body larger than {self.max_bytes} bytes",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": 413,
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )  # the rest of the body is not read either
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass
