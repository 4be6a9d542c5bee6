"""TEMPORARY (until core's AsyncLLM lands `call_utility` and `kv_transfer=`): main's in-process
AsyncLLM with the engine-core P/D service, so the P/D routes run on today's engine."""
from __future__ import annotations

import asyncio
import queue
from concurrent.futures import Future
from typing import Any

from tandem.engine.async_llm import AsyncLLM
from tandem.engine.pd_service import PDService


class ClusterLLM(AsyncLLM):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        super().__init__(*args, **kwargs)
        self.pd = PDService(self.engine)

    async def call_utility(self, name: str, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._calls.put((lambda: getattr(self.pd, name)(*args), fut, loop))
        self._wake.set()
        result = await fut
        return await asyncio.wrap_future(result) if isinstance(result, Future) else result

    def generate(self, prompt, params, request_id=None, priority=None, precision=None, kv_transfer=None):
        after = None
        if kv_transfer is not None:
            after = lambda e: self.pd.on_add(request_id, kv_transfer, request_id in e.scheduler.requests)  # noqa: E731
        return super().generate(prompt, params, request_id, priority, after_add=after, precision=precision)

    def _drain_commands(self) -> None:
        super()._drain_commands()
        while True:
            try:
                fn, fut, loop = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                result, error = fn(), None
            except Exception as e:
                result, error = None, e
            loop.call_soon_threadsafe(_resolve, fut, result, error)


def _resolve(fut: asyncio.Future, result: Any, error: Exception | None) -> None:
    if not fut.done():
        fut.set_exception(error) if error is not None else fut.set_result(result)
