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

from tandem.config import EngineConfig
from tandem.engine.channel import Channel
from tandem.engine.core_messages import EngineCoreEvent, EngineDead, Ready, Shutdown

log = logging.getLogger(__name__)
DEATH_CHECK_S = 0.1
STARTUP_TIMEOUT_S = 900.0  # building the engine: loading (and converting) weights, compiling


def _run_engine_core(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    parent_pid: int,
    log_level: int,
    niceness: int,
) -> None:
    """The engine-core process's entry, named here so that starting it imports nothing heavy on
    this (the front end's) side: the core's modules bring in torch."""
    from tandem.engine.core_proc import run_engine_core

    run_engine_core(config, input_addr, output_addr, parent_pid, log_level, niceness)


class EngineCoreClient:
    def __init__(
        self,
        config: EngineConfig,
        on_event: Callable[[Any], None],
        on_dead: Callable[[str], None],
        in_process: bool = False,
        startup_timeout: float = STARTUP_TIMEOUT_S,
        niceness: int = 0,
    ) -> None:
        """niceness: the engine-core process's CPU niceness (0-19; the caller's stays), so that on a
        machine with few cores this process (HTTP, detokenising, SSE) runs when it wakes."""
        if not isinstance(niceness, int) or not 0 <= niceness <= 19:
            raise ValueError(f"engine niceness must be an integer in [0, 19], got {niceness!r}")
        if niceness and in_process:
            raise ValueError(
                "engine niceness applies to an engine core in its own process, not in-process"
            )
        self._on_event, self._on_dead = on_event, on_dead
        self._dir = tempfile.mkdtemp(prefix="tandem-core-")
        input_addr, output_addr = f"ipc://{self._dir}/input", f"ipc://{self._dir}/output"
        self._channel = Channel(output_addr, input_addr, bind=True, decode_type=EngineCoreEvent)
        self.send = self._channel.send
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
            ctx = multiprocessing.get_context("spawn")
            self.process = ctx.Process(
                target=_run_engine_core,
                name="tandem-engine-core",
                daemon=True,
                args=(
                    config,
                    input_addr,
                    output_addr,
                    os.getpid(),
                    logging.getLogger().getEffectiveLevel(),
                    niceness,
                ),
            )
            self.process.start()
        try:
            self.ready = self._wait_ready(startup_timeout)
            if in_process:
                built.wait(startup_timeout)
        except BaseException:
            self.shutdown()
            raise
        self._receiver = threading.Thread(
            target=self._receive, name="tandem-core-client", daemon=True
        )
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
            if self._channel.poll(int(DEATH_CHECK_S * 1000)):
                for msg in self._channel.receive():
                    if isinstance(msg, EngineDead):
                        raise RuntimeError(msg.message)
                    if isinstance(msg, Ready):  # the first message the core sends
                        return msg
            elif not self.alive:
                raise RuntimeError(f"the engine core exited before it was ready{self._exit_code()}")
        raise TimeoutError(f"the engine core was not ready within {timeout:g} s")

    def _exit_code(self) -> str:
        code = self.process.exitcode if self.process is not None else None
        return f" (exit code {code})" if code is not None else ""

    def _receive(self) -> None:
        while not self._closed:
            if self._channel.poll(int(DEATH_CHECK_S * 1000)):
                for msg in self._channel.receive():
                    try:
                        self._on_event(msg)
                    except Exception:  # one bad event must not stop the receiving
                        log.exception("engine-core event not handled")
                continue
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
        self._closed = True
        receiver = getattr(self, "_receiver", None)
        if receiver is not None and receiver is not threading.current_thread():
            receiver.join(2)
        self._channel.close()
        shutil.rmtree(self._dir, ignore_errors=True)
