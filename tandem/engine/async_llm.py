"""The engine behind a server: the step loop runs on its own thread, and each request
streams its outputs to the asyncio side through a queue. Adds and aborts reach the loop as
commands, so the engine itself is only ever touched by one thread."""
from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tandem.config import EngineConfig
from tandem.core.sampling_params import SamplingParams
from tandem.engine.llm_engine import LLMEngine, PromptType
from tandem.engine.output_processor import RequestOutput

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the asyncio side may read while the engine thread moves on."""
    snap = copy.copy(out)
    snap.outputs = [copy.copy(o) for o in out.outputs]
    for o in snap.outputs:
        o.token_ids = list(o.token_ids)
        if o.logprobs is not None:
            o.logprobs = list(o.logprobs)
    snap.metrics = copy.copy(out.metrics)
    return snap


class AsyncLLM:
    def __init__(self, config: EngineConfig,
                 on_step: Callable[[LLMEngine, float | None, list[RequestOutput]], None] | None = None) -> None:
        self.engine = LLMEngine(config)
        # Metrics hook, on the engine thread: after each step (with its duration), and with
        # None for requests that ended outside a step (aborted).
        self.on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._held: list[tuple[str, Any]] = []  # commands _admit_arrivals left for the next drain
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = False
        self._ids = itertools.count()
        self.engine.on_step_boundary = self._admit_arrivals
        self._thread = threading.Thread(target=self._loop, name="tandem-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._commands.qsize()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.pipeline.shutdown()

    # ---- asyncio side -------------------------------------------------------------
    def generate(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None,
                 priority: int | None = None, after_add: Callable[[LLMEngine], None] | None = None,
                 precision: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queues the request at once (so admission control counts it), then yields a
        snapshot per step that produced tokens; the last one has finished=True. Iterating
        raises ValueError on bad input (nothing queued). Leaving early aborts the request.
        `after_add(engine)` runs on the engine thread right after the add is tried, accepted
        or not, before any step can schedule the request (P/D: index its received KV, which is
        released the usual way if the request never runs); its errors are logged."""
        if not self._thread.is_alive():
            raise EngineDeadError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        request_id = request_id or f"req-{next(self._ids)}"
        accepted = loop.create_future()
        stream = _Stream(loop, asyncio.Queue())
        self._commands.put(("add", (prompt, params, request_id, priority, stream, accepted, after_add, precision)))
        self._wake.set()
        return self._stream(request_id, stream, accepted)

    async def _stream(self, request_id: str, stream: _Stream, accepted: asyncio.Future) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            await accepted  # raises the engine's ValueError
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    # ---- engine thread ------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while not self._stop:
            self._drain_commands()
            if not engine.has_unfinished_requests():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            start = time.perf_counter()
            try:
                outputs = engine.step()
            except Exception as e:  # keep serving: fail what was in flight, free its blocks
                log.exception("engine step failed")
                self._fail_all(RuntimeError(f"engine error: {e}"))
                continue
            elapsed = time.perf_counter() - start
            if self.on_step is not None:
                self.on_step(engine, elapsed, outputs)
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, _snapshot(out))
                    if out.finished:
                        del self._streams[out.request_id]

    def _pending_commands(self) -> Iterator[tuple[str, Any]]:
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _drain_commands(self) -> None:
        held, self._held = self._held, []
        for kind, arg in [*held, *self._pending_commands()]:
            if kind == "add":
                self._add(*arg)
            else:
                self._streams.pop(arg, None)
                out = self.engine.abort_request(arg)
                if out is not None and self.on_step is not None:
                    self.on_step(self.engine, None, [out])

    def _admit_arrivals(self) -> None:
        """Between two overlapped steps: take in new requests, up to the first abort. That
        abort and all behind it wait for the next drain, in order, since a block freed now
        could be handed to an arrival within the step that still reads it."""
        for command in self._pending_commands():
            if command[0] == "add" and not self._held:
                self._add(*command[1])
            else:
                self._held.append(command)

    def _add(self, prompt: PromptType, params: SamplingParams, request_id: str, priority: int | None,
             stream: _Stream, accepted: asyncio.Future, after_add: Callable[[LLMEngine], None] | None,
             precision: str | None = None) -> None:
        try:
            self.engine.add_request(prompt, params, request_id, priority=priority, precision=precision)
        except Exception as e:
            stream.loop.call_soon_threadsafe(_set_exception, accepted, e)
        else:
            self._streams[request_id] = stream
            stream.loop.call_soon_threadsafe(_set_result, accepted)
        if after_add is not None:
            try:
                after_add(self.engine)
            except Exception:
                log.warning("after_add hook of %s failed; the request goes on without it", request_id, exc_info=True)

    def _fail_all(self, error: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
        self._streams.clear()


def _set_result(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_exception(fut: asyncio.Future, e: Exception) -> None:
    if not fut.done():
        fut.set_exception(e)
