"""How `tandem serve` stops. SIGTERM (or Ctrl-C): stop admitting (every request but /metrics
gets a 503), let the requests in flight finish, end those left when `shutdown_timeout` seconds
are nearly up (less STOP_S, what stopping takes) with an error their clients see, and exit 0
within the timeout; a second signal exits at once. Engine-core death:
every request in flight has already ended with an error (AsyncLLM), /health answers 503, and
the server exits 1 after `DEAD_GRACE_S`, so a supervisor (systemd, Kubernetes, `tandem cluster
up`) restarts the pair: the KV cache and every request's state died with the core, so an
in-place restart of the core would save no work and would hide a crash loop."""

from __future__ import annotations

import json
import logging
import threading
import time

import uvicorn

from tandem.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)
DEAD_GRACE_S = 0.5  # error events and 5xx answers reach their clients before the server exits
STOP_S = 1.5  # what stopping takes after the aborts (the grace, uvicorn, the engine core): kept
# out of the shutdown timeout, so the process is gone within it
EXEMPT = ("/metrics",)


class Lifecycle:
    def __init__(self, llm: AsyncLLM, shutdown_timeout: float) -> None:
        self.llm = llm
        self.shutdown_timeout = shutdown_timeout
        self.draining = False
        self.exit_code = 0
        self.server: uvicorn.Server | None = None

    def refusing(self) -> str | None:
        """Why a new request gets a 503 now, or None."""
        if self.draining:
            return "the server is shutting down"
        if not self.llm.alive:
            return "the engine core is not running"
        return None

    def drain(self) -> None:
        """SIGTERM: wait for the requests in flight, abort what is left, then stop the server."""
        self.draining = True
        deadline = time.monotonic() + max(self.shutdown_timeout - STOP_S, 0.0)
        while self.llm.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.llm.num_in_flight:
            log.warning("shutdown timeout: aborting %d requests in flight", self.llm.num_in_flight)
            self.llm.abort_all("the server is shutting down: request aborted")
            time.sleep(DEAD_GRACE_S)
        self._stop()

    def engine_died(self, message: str) -> None:
        """AsyncLLM.on_dead (its receiver thread)."""
        self.exit_code = 1
        threading.Timer(DEAD_GRACE_S, self._stop).start()

    def _stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True


class Server(uvicorn.Server):
    """uvicorn, with a first SIGTERM / SIGINT that drains instead of exiting."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        lifecycle.server = self

    def handle_exit(self, sig, frame) -> None:
        if self.lifecycle.draining:  # a second signal: stop now
            super().handle_exit(sig, frame)
            return
        log.info(
            "draining: no new requests; waiting up to %g s for %d in flight",
            self.lifecycle.shutdown_timeout,
            self.lifecycle.llm.num_in_flight,
        )
        self.lifecycle.draining = True
        threading.Thread(target=self.lifecycle.drain, name="tandem-drain", daemon=True).start()


class RefuseWhenStopping:
    """ASGI middleware: a 503 for every request (but /metrics) while draining or with the
    engine core gone."""

    def __init__(self, app, lifecycle: Lifecycle) -> None:
        self.app, self.lifecycle = app, lifecycle

    async def __call__(self, scope, receive, send) -> None:
        why = (
            self.lifecycle.refusing()
            if scope["type"] == "http" and scope["path"] not in EXEMPT
            else None
        )
        if why is None:
            await self.app(scope, receive, send)
            return
        body = json.dumps(
            {"error": {"message": why, "type": "server_error", "param": None, "code": 503}}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")],
            }
        )
        await send({"type": "http.response.body", "body": body})
