"""One end of the link between the API process and the engine core: a ZeroMQ PULL socket it
receives on and a PUSH socket it sends on (ipc), msgpack (msgspec) both ways. The API side binds,
the core connects. No high-water mark: a send never blocks the event loop or a step."""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import zmq


class Channel:
    def __init__(self, recv_addr: str, send_addr: str, bind: bool, decode_type: Any) -> None:
        self._ctx = zmq.Context()
        self._ctx.setsockopt(zmq.SNDHWM, 0)
        self._ctx.setsockopt(zmq.RCVHWM, 0)
        self._recv = self._ctx.socket(zmq.PULL)
        self._send = self._ctx.socket(zmq.PUSH)
        for sock, addr in ((self._recv, recv_addr), (self._send, send_addr)):
            sock.bind(addr) if bind else sock.connect(addr)
        self._lock = threading.Lock()  # sends come from several threads
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(decode_type)
        self.closed = False

    def send(self, msg: Any) -> None:
        data = self._encoder.encode(msg)
        with self._lock:
            if not self.closed:
                self._send.send(data, copy=False)

    def poll(self, timeout_ms: int) -> bool:
        """Whether a message waits (after up to timeout_ms)."""
        return bool(self._recv.poll(timeout_ms))

    def receive(self) -> list[Any]:
        """Every message waiting now, decoded, in order."""
        msgs = []
        while True:
            try:
                msgs.append(self._decoder.decode(self._recv.recv(zmq.NOBLOCK, copy=False)))
            except zmq.Again:
                return msgs

    def close(self, linger_ms: int = 0) -> None:
        """From the thread that polls (or once it has stopped)."""
        with self._lock:
            self.closed = True
        self._recv.close(linger=0)
        self._send.close(linger=linger_ms)
        self._ctx.term()
