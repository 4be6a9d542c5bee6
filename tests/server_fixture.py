"""Run a real `tandem serve` app (uvicorn on loopback) in a background thread for tests."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import uvicorn

from tandem.config import EngineConfig
from tandem.engine.async_llm import AsyncLLM
from tandem.server.api_server import ServerConfig, build_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(app):
    """Serve an ASGI app on a free loopback port; yields (url, uvicorn.Server)."""
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not srv.started and time.time() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", srv
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


@contextmanager
def running_server(engine: EngineConfig, server: ServerConfig):
    """The engine core on a thread of the test process (AsyncLLM's in-process mode): the same
    messages as the separate process, without its start-up."""
    llm = AsyncLLM(engine, in_process=True)
    try:
        with serving(build_app(llm, server)) as (url, _):
            yield url, llm
    finally:
        llm.shutdown()
