"""The API side's end of the engine core: starts it (a spawned process, or a thread in the
in-process mode), sends it messages, and hands each message it sends back to `on_event` on a
receiver thread. Engine-core death (the process gone, the thread ended) is noticed within
DEATH_CHECK_S and reported once to `on_dead`."""
from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from tandem.config import EngineConfig
from tandem.engine.core_messages import EngineCoreEvent, EngineDead, Ready, Shutdown

log = logging.getLogger(__name__)
DEATH_CHECK_S = 0.1
STARTUP_TIMEOUT_S = 900.0  # building the engine: loading (and converting) weights, compiling


class EngineCoreClient:
    def __init__(self, config: EngineConfig, on_event: Callable[[Any], None], on_dead: Callable[[str], None],
                 in_process: bool = False, startup_timeout: float = STARTUP_TIMEOUT_S) -> None:
        self._on_event, self._on_dead = on_event, on_dead
        self._dir = tempfile.mkdtemp(prefix="tandem-core-")
        input_addr, output_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._ctx = zmq.Context()
        self._ctx.setsockopt(zmq.SNDHWM, 0)  # no high-water mark: a send never blocks the event loop
        self._ctx.setsockopt(zmq.RCVHWM, 0)
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.bind(input_addr)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(output_addr)
        self._send_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreEvent)
        self._closed = False
        self.process: multiprocessing.process.BaseProcess | None = None
        self._thread: threading.Thread | None = None
        self.engine_core = None  # in the in-process mode, the EngineCore itself (tests read it)
        built = threading.Event()
        if in_process:
            from tandem.engine.core_proc import EngineCoreProc

            def run() -> None:
                try:
                    proc = EngineCoreProc(config, input_addr, output_addr)
                    self.engine_core = proc.core
                    built.set()
                    proc.run()
                except BaseException:
                    log.exception("in-process engine core ended")
            self._thread = threading.Thread(target=run, name="tandem-engine-core", daemon=True)
            self._thread.start()
        else:
            from tandem.engine.core_proc import run_engine_core
            ctx = multiprocessing.get_context("spawn")
            self.process = ctx.Process(target=run_engine_core, name="tandem-engine-core", daemon=True,
                                       args=(config, input_addr, output_addr, os.getpid(),
                                             logging.getLogger().getEffectiveLevel()))
            self.process.start()
        try:
            self.ready = self._wait_ready(startup_timeout)
            if in_process:
                built.wait(startup_timeout)
        except BaseException:
            self.shutdown()
            raise
        self._receiver = threading.Thread(target=self._receive, name="tandem-core-client", daemon=True)
        self._receiver.start()

    @property
    def alive(self) -> bool:
        if self.process is not None:
            return self.process.is_alive()
        return self._thread is not None and self._thread.is_alive()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def _wait_ready(self, timeout: float) -> Ready:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._output.poll(int(DEATH_CHECK_S * 1000)):
                msg = self._decoder.decode(self._output.recv())
                if isinstance(msg, Ready):
                    return msg
                if isinstance(msg, EngineDead):
                    raise RuntimeError(msg.message)
            elif not self.alive:
                raise RuntimeError(f"the engine core exited before it was ready{self._exit_code()}")
        raise TimeoutError(f"the engine core was not ready within {timeout:g} s")

    def _exit_code(self) -> str:
        code = self.process.exitcode if self.process is not None else None
        return f" (exit code {code})" if code is not None else ""

    def send(self, msg: Any) -> None:
        data = self._encoder.encode(msg)
        with self._send_lock:
            if not self._closed:
                self._input.send(data, copy=False)

    def _receive(self) -> None:
        while not self._closed:
            try:
                if self._output.poll(int(DEATH_CHECK_S * 1000)):
                    while True:
                        try:
                            data = self._output.recv(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_event(self._decoder.decode(data))
                    continue
            except zmq.ZMQError:
                if self._closed:
                    return
                raise
            if not self.alive and not self._closed:
                self._on_dead(f"the engine core died{self._exit_code()}")
                return

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to stop; kill it if it does not."""
        if self._closed:
            return
        if self.alive:
            self.send(Shutdown())
        if self.process is not None:
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
        elif self._thread is not None:
            self._thread.join(timeout)
        with self._send_lock:
            self._closed = True
        receiver = getattr(self, "_receiver", None)
        if receiver is not None and receiver is not threading.current_thread():
            receiver.join(2)
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
