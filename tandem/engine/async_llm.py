"""The engine behind a server: the front end (tokenise + the prompt rules, detokenise + stop
strings) in the API process, the engine core in its own process (or, `in_process=True`, on a
thread of this one, with the same messages: for tests). Each request streams its outputs to the
asyncio side through a queue; outputs are processed on the client's receiver thread."""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from tandem.config import EngineConfig
from tandem.core.sampling_params import SamplingParams
from tandem.engine.core_client import EngineCoreClient
from tandem.engine.core_messages import (
    AbortRequests,
    AddResult,
    EngineCoreOutputs,
    EngineDead,
    RequestErrors,
    SchedulerStats,
    UtilityMessage,
    UtilityResult,
    child_ids,
    remote_error,
    utility_call,
)
from tandem.engine.input_processor import InputProcessor, PromptType
from tandem.engine.output_processor import OutputProcessor, RequestOutput
from tandem.engine.precision import PrecisionRouter
from tandem.engine.tokenizer import get_tokenizer

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    accepted: asyncio.Future


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the asyncio side may read while the receiver thread moves on."""
    snap = copy.copy(out)
    snap.outputs = [copy.copy(o) for o in out.outputs]
    for o in snap.outputs:
        o.token_ids = list(o.token_ids)
        if o.logprobs is not None:
            o.logprobs = list(o.logprobs)
    snap.metrics = copy.copy(out.metrics)
    return snap


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        in_process: bool = False,
        on_dead: Callable[[str], None] | None = None,
        engine_niceness: int = 0,
    ) -> None:
        self.config = config
        model = config.model_config
        self.tokenizer = get_tokenizer(model.model, model.tokenizer, model.chat_template)
        # Metrics hook, on the receiver thread: after each step (with its duration) and with
        # None for requests that ended outside a step (aborted).
        self.on_step: (
            Callable[[float | None, list[RequestOutput], SchedulerStats | None], None] | None
        ) = None
        self.on_dead = on_dead  # called once, on the receiver thread, when the engine core dies
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats = (
            SchedulerStats()
        )  # the engine's state after its latest step (first: the handshake's)
        self._lock = threading.Lock()  # the output processor and the tables below
        self._streams: dict[str, _Stream] = {}
        self._unanswered_adds = 0
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._ids = itertools.count()
        self._call_ids = itertools.count()
        self._dead: str | None = None
        self._client = EngineCoreClient(
            config, self._on_event, self._on_dead, in_process, niceness=engine_niceness
        )
        ready = self._client.ready
        # The engine facts (from the core's ready handshake).
        self.max_model_len, self.vocab_size = ready.max_model_len, ready.vocab_size
        self.eos_token_id, self.block_size, self.num_kv_blocks = (
            ready.eos_token_id,
            ready.block_size,
            ready.num_kv_blocks,
        )
        self.weight_bytes = ready.weight_bytes
        self.engine_pid = ready.pid
        self.engine_core = (
            self._client.engine_core
        )  # in_process only: the EngineCore (tests); else None
        self.stats = ready.stats
        self.precisions = PrecisionRouter(
            config.quant_config, ready.default_precision, ready.unavailable_precisions
        )
        self.input_processor = InputProcessor(
            config.scheduler_config,
            self.tokenizer,
            self.vocab_size,
            self.max_model_len,
            self.precisions,
        )

    @property
    def alive(self) -> bool:
        return self._dead is None and self._client.alive

    @property
    def num_waiting(self) -> int:
        """Waiting in the core as of its latest step, plus adds it has not answered yet."""
        return self.stats.num_waiting + self._unanswered_adds

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def tokenize(self, prompt: PromptType) -> list[int]:
        return self.input_processor.tokenize(prompt)

    def shutdown(self) -> None:
        self._client.shutdown()

    # ---- asyncio side -------------------------------------------------------------
    def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int | None = None,
        precision: str | None = None,
        kv_transfer: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queues the request at once (so admission control counts it), then yields a
        snapshot per step that produced tokens; the last one has finished=True. Bad input is a
        ValueError (nothing queued): the front end's rules at the call, the core's (a reused id,
        a constraint that does not compile) while iterating. Leaving early aborts the request.
        `kv_transfer`: handed to the engine core's on_add hooks with the add (P/D), which run
        whether the add is accepted or not, before any step can schedule the request."""
        if not self.alive:
            raise EngineDeadError(self._dead or "the engine core is not running")
        loop = asyncio.get_running_loop()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        request = self.input_processor.process(
            request_id, prompt, params, None, priority, precision
        )
        stream = _Stream(loop, asyncio.Queue(), loop.create_future())
        request.kv_transfer = kv_transfer
        with self._lock:
            self.output_processor.add(
                request_id,
                prompt if isinstance(prompt, str) else None,
                request.prompt_token_ids,
                list(zip(child_ids(request_id, params.n), request.params)),
                request.arrival_time,
                request.priority,
                request.precision,
            )
            self._streams[request_id] = stream
            self._unanswered_adds += 1
        self._client.send(request)
        return self._stream(request_id, stream)

    async def _stream(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            await stream.accepted  # raises the front end's or the core's ValueError
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            outs = self.output_processor.abort(self.output_processor.child_ids(request_id))
        self._client.send(AbortRequests([request_id]))
        if outs and self.on_step is not None:
            self.on_step(None, outs, None)

    def abort_all(self, message: str) -> None:
        """End every request in flight with `message` as the error its client sees."""
        with self._lock:
            streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self._client.send(AbortRequests([request_id]))
            with self._lock:
                outs = self.output_processor.abort(self.output_processor.child_ids(request_id))
            if outs and self.on_step is not None:
                self.on_step(None, outs, None)
            _put(stream, RuntimeError(message))

    async def call_utility(self, message: UtilityMessage) -> Any:
        """Have the engine core answer a utility message (core_messages.py) between two steps;
        its result (a Future's once it resolves), as msgpack decodes it (a struct as a dict).
        TypeError (nothing sent) for anything but a utility message; ValueError,
        KVPoolFullError and TimeoutError are raised as themselves, any other error as
        RuntimeError."""
        if not self.alive:
            raise EngineDeadError(self._dead or "the engine core is not running")
        call = utility_call(next(self._call_ids), message)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._calls[call.call_id] = (loop, future)
        self._client.send(call)
        return await future

    # ---- receiver thread ----------------------------------------------------------
    def _on_event(self, msg: Any) -> None:
        if isinstance(msg, EngineCoreOutputs):
            self._on_outputs(msg)
        elif isinstance(msg, AddResult):
            self._on_added(msg)
        elif isinstance(msg, UtilityResult):
            with self._lock:
                loop, future = self._calls.pop(msg.call_id)
            error = remote_error(*msg.error) if msg.error is not None else None
            loop.call_soon_threadsafe(_resolve, future, msg.result, error)
        elif isinstance(msg, RequestErrors):
            for request_id in msg.request_ids:
                with self._lock:
                    stream = self._streams.pop(request_id, None)
                    self.output_processor.abort(
                        self.output_processor.child_ids(request_id), "error"
                    )
                if stream is not None:
                    _put(stream, RuntimeError(msg.message))
        elif isinstance(msg, EngineDead):
            self._on_dead(msg.message)

    def _on_added(self, msg: AddResult) -> None:
        with self._lock:
            self._unanswered_adds -= 1
            stream = self._streams.get(msg.request_id)
            if stream is not None and msg.error is not None:
                del self._streams[msg.request_id]
                self.output_processor.abort(self.output_processor.child_ids(msg.request_id))
        if stream is not None:
            error = remote_error(*msg.error) if msg.error is not None else None
            stream.loop.call_soon_threadsafe(_resolve, stream.accepted, None, error)

    def _on_outputs(self, msg: EngineCoreOutputs) -> None:
        if msg.stats is not None:
            # the core sends its cached-prefix list only when it takes one (every 0.2 s at most)
            msg.stats.instance.setdefault(
                "cached_prefixes", self.stats.instance.get("cached_prefixes", [])
            )
            self.stats = msg.stats
        with self._lock:
            self.output_processor.on_scheduled(msg.scheduled)
            outputs, stopped = self.output_processor.process(msg.outputs, msg.timestamp)
            deliveries = []
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    deliveries.append((stream, _snapshot(out)))
                    if out.finished:
                        del self._streams[out.request_id]
        if stopped:  # a stop string ended these sequences: the core still runs them
            self._client.send(AbortRequests(stopped, stopped=True))
        if self.on_step is not None:
            self.on_step(msg.step_seconds, outputs, msg.stats)
        _put_all(deliveries)

    def _on_dead(self, message: str) -> None:
        if self._dead is not None:
            return
        self._dead = message
        log.error("%s: failing every request in flight", message)
        with self._lock:
            streams, self._streams = self._streams, {}
            calls, self._calls = self._calls, {}
        error = EngineDeadError(message)
        for stream in streams.values():
            stream.loop.call_soon_threadsafe(_resolve, stream.accepted, None, error)
            _put(stream, error)
        for loop, future in calls.values():
            loop.call_soon_threadsafe(_resolve, future, None, error)
        if self.on_dead is not None:
            self.on_dead(message)


def _put(stream: _Stream, item: Any) -> None:
    _put_all([(stream, item)])


def _put_all(deliveries: list[tuple[_Stream, Any]]) -> None:
    """Hand a step's items to their streams with one wake-up per event loop, not one per
    stream (each call_soon_threadsafe writes to the loop's self-pipe: 64 syscalls a step at
    concurrency 64)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
    for stream, item in deliveries:
        by_loop.setdefault(stream.loop, []).append((stream.queue, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if not future.done():
        future.set_exception(error) if error is not None else future.set_result(result)
