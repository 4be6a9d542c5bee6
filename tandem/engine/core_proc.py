"""The engine-core process: an EngineCore behind two ZeroMQ sockets (requests in, outputs out),
driven by a busy loop. Between steps it takes in every add, abort and utility call waiting on
the socket; between two overlapped steps (async scheduling) it admits arrivals only, up to the
first other command, so a block freed now is never handed out while a step still reads it.
The same loop runs on a thread of the API process in the in-process mode (tests)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

from tandem.config import EngineConfig
from tandem.core.request import RequestStatus
from tandem.engine.channel import Channel
from tandem.engine.core import EngineCore, ExecutorFactory, model_runner_factory
from tandem.engine.core_messages import (
    AbortRequests,
    AddResult,
    EngineCoreInput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    Ready,
    RequestErrors,
    Shutdown,
    UtilityCall,
    UtilityResult,
    decode_utility,
    error_of,
)
from tandem.engine.pd_service import PDService
from tandem.heap import freeze_startup_heap

log = logging.getLogger(__name__)
IDLE_POLL_MS = 50  # how long an idle loop waits on the socket before looking again
PR_SET_PDEATHSIG = 1


class EngineCoreProc:
    def __init__(
        self,
        config: EngineConfig,
        input_addr: str,
        output_addr: str,
        executor_factory: ExecutorFactory = model_runner_factory,
    ) -> None:
        self._channel = Channel(input_addr, output_addr, bind=False, decode_type=EngineCoreInput)
        self._send = self._channel.send  # also from utility Futures' threads
        try:
            self.core = EngineCore(config, executor_factory)
            pd = PDService(self.core)  # P/D: the KV links and handoff utilities
            self.core.register_utilities(pd.utilities(), pd.on_add)
        except BaseException as e:
            self._send(EngineDead(f"the engine core failed to start: {type(e).__name__}: {e}"))
            self.close()
            raise
        self.core.on_step_boundary = self._admit_arrivals
        self._held: list[Any] = []  # commands _admit_arrivals left for the next drain
        self._stop = False
        ex = self.core.executor
        # sent as run() starts: in its own process the core freezes its startup heap in between
        self._ready = Ready(
            self.core.max_model_len,
            self.core.vocab_size,
            self.core.eos_token_id,
            ex.block_size,
            ex.num_kv_blocks,
            ex.variants.default,
            dict(ex.variants.unavailable),
            dict(ex.variants.weight_bytes),
            os.getpid(),
            self.core.scheduler_stats(),
        )

    def close(self) -> None:
        self._channel.close(linger_ms=1000)  # what is sent still leaves

    # ---- the busy loop --------------------------------------------------------------
    def run(self) -> None:
        core = self.core
        self._send(self._ready)
        try:
            while not self._stop:
                idle = not core.has_unfinished_requests()
                handled = self._drain(IDLE_POLL_MS if idle else 0)
                if core.has_unfinished_requests():
                    self._step()
                elif handled:  # an abort or add that ran no step: the stats still change
                    self._send(
                        EngineCoreOutputs([], time.monotonic(), stats=core.scheduler_stats())
                    )
        finally:
            core.pipeline.shutdown()
            self.close()

    def _step(self) -> None:
        core = self.core
        try:
            out = core.step()
        except Exception as e:  # keep serving: fail what was in flight, free its blocks
            log.exception("engine step failed")
            ids = core.unfinished_request_ids()
            core.abort_requests(ids)
            self._send(RequestErrors(ids, f"engine error: {e}"))
            return
        if out is not None:
            out.stats = core.scheduler_stats()
            self._send(out)

    def _pending(self, timeout_ms: int) -> list[Any]:
        if timeout_ms and not self._channel.poll(timeout_ms):
            return []
        return self._channel.receive()

    def _drain(self, timeout_ms: int) -> bool:
        held, self._held = self._held, []
        commands = [*held, *self._pending(0 if held else timeout_ms)]
        for msg in commands:
            self._handle(msg)
        return bool(commands)

    def _admit_arrivals(self) -> None:
        """Between two overlapped steps: take in new requests, up to the first other command.
        That one and all behind it wait for the next drain, in order."""
        for msg in self._pending(0):
            if isinstance(msg, EngineCoreRequest) and not self._held:
                self._handle(msg)
            else:
                self._held.append(msg)

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, EngineCoreRequest):
            try:
                self.core.add_request(msg)
            except Exception as e:
                self._send(AddResult(msg.request_id, error_of(e)))
            else:
                self._send(AddResult(msg.request_id))
        elif isinstance(msg, AbortRequests):
            status = (
                RequestStatus.FINISHED_STOPPED if msg.stopped else RequestStatus.FINISHED_ABORTED
            )
            self.core.abort_requests(msg.request_ids, status)
        elif isinstance(msg, UtilityCall):
            self._call_utility(msg)
        elif isinstance(msg, Shutdown):
            self._stop = True

    def _call_utility(self, call: UtilityCall) -> None:
        try:
            result = self.core.utility(decode_utility(call))
        except Exception as e:
            self._send(UtilityResult(call.call_id, error=error_of(e)))
            return
        if isinstance(result, Future):  # replied when it resolves; the loop goes on
            result.add_done_callback(lambda f: self._send(_future_result(call.call_id, f)))
        else:
            self._send(UtilityResult(call.call_id, result))


def _future_result(call_id: int, future: Future) -> UtilityResult:
    error = future.exception()
    if error is not None:
        return UtilityResult(call_id, error=error_of(error))
    return UtilityResult(call_id, future.result())


def _die_with_parent(parent_pid: int) -> None:
    """The kernel kills this process when its parent dies (Linux); a watchdog covers the rest
    (another OS, or a parent that was already gone)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="tandem-parent-watchdog", daemon=True).start()


def run_engine_core(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    parent_pid: int,
    log_level: int = logging.INFO,
    niceness: int = 0,
) -> None:
    """The engine-core process's entry point (what core_client's spawn target runs)."""
    _die_with_parent(parent_pid)
    # Ctrl-C, and a SIGTERM to the whole process group (systemd, a terminal), reach this process
    # too: the API process drains first, then sends Shutdown (or dies, and this process with it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s engine-core: %(message)s"
    )
    import torch

    # The cores go to the engine; the API process runs no torch (see docs/architecture.md).
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(config.device_config.num_threads or cores or 1)
    if niceness:  # before the model loads: every thread torch starts inherits it
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
    try:
        proc = EngineCoreProc(config, input_addr, output_addr)
    except BaseException:
        log.exception("engine core failed to start")
        sys.exit(1)
    freeze_startup_heap("engine core")
    proc.run()
    logging.shutdown()
    os._exit(0)  # the sockets are closed and nothing else is left to write: skip torch's teardown
