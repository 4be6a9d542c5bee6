"""Point-to-point over a torch.distributed process group: gloo between CPU processes, NCCL
between GPUs. On NCCL a CUDA payload is sent as it is (device to device, over NVLink or
RDMA where present: no host bounce).

Wire format per transfer: an int64 length, the JSON metadata (uint8), then one message per
layer. All layer sends are posted at once and all layer receives are posted as soon as the
metadata is known, so the transport streams them back to back while the receiver places
layer l (on_layer) as layer l+1 is still arriving.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time

import torch
import torch.distributed as dist

from tandem.executor.kv_transfer.base import LayerSink
from tandem.executor.kv_transfer.payload import KVPayload, TransferStats, as_bytes, empty_like_meta

log = logging.getLogger(__name__)


def init_kv_group(
    rank: int,
    world_size: int,
    init_method: str | None = "env://",
    backend: str | None = None,
    store: dist.Store | None = None,
    timeout: datetime.timedelta | None = None,
) -> None:
    """Join the default process group the transports talk over (once per process), by
    `init_method` or an existing rendezvous `store`: NCCL when CUDA is available, else gloo.
    With NCCL, set this process's GPU first."""
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(
            backend,
            init_method=None if store is not None else init_method,
            rank=rank,
            world_size=world_size,
            store=store,
            timeout=timeout,
        )


class TorchDistTransport:
    """The link to one peer rank. Transfers between two ranks arrive in send order; one that
    arrives before it is asked for waits in a stash. A timed-out receive leaves its posted
    header receive in place, so the next call picks the transfer up where it left off. Sends
    and receives may run on two threads over gloo; NCCL wants one thread per communicator, so
    there drive a link from one thread (NCCL is not tested here: it needs two GPUs)."""

    def __init__(self, peer: int, group: dist.ProcessGroup | None = None) -> None:
        self.peer, self.group = peer, group
        nccl = dist.get_backend(group) == "nccl"
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        )
        self._stash: dict[str, tuple[KVPayload, TransferStats]] = {}
        self._header: tuple[_Arrival, torch.Tensor] | None = None
        self._send_lock, self._recv_lock = threading.Lock(), threading.Lock()

    def send(self, transfer_id: str, payload: KVPayload) -> TransferStats:
        with self._send_lock:
            meta = json.dumps(payload.meta(transfer_id)).encode()
            length = torch.tensor([len(meta)], dtype=torch.int64, device=self.device)
            meta_t = torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(self.device)
            kv = payload.kv.to(
                self.device
            )  # a no-op for a CUDA payload on NCCL, or a CPU one on gloo
            works = [self._isend(length), self._isend(meta_t)]
            works += [self._isend(as_bytes(kv[layer])) for layer in self._layers(payload)]
            stats = TransferStats(payload.num_bytes)
            for i, work in enumerate(works):
                work.wait()
                if (
                    i == 0
                ):  # gloo completes a send once the peer receives: time the transfer, not that wait
                    start = time.perf_counter()
                elif i >= 2:
                    stats.layer_seconds.append(time.perf_counter() - start)
            self._sync()
            stats.seconds = time.perf_counter() - start
        log.debug(
            "kv send %s to rank %d: %d bytes in %.2f ms (%.2f GB/s)",
            transfer_id,
            self.peer,
            stats.num_bytes,
            stats.seconds * 1e3,
            stats.gbps,
        )
        return stats

    def recv(
        self, transfer_id: str, timeout: float | None = None, on_layer: LayerSink | None = None
    ) -> tuple[KVPayload, TransferStats]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._recv_lock:
            while transfer_id not in self._stash:
                meta = self._recv_meta(deadline, timeout)
                got = self._recv_layers(
                    meta, on_layer if meta["transfer_id"] == transfer_id else None
                )
                if meta["transfer_id"] == transfer_id:
                    return got
                self._stash[meta["transfer_id"]] = got
            payload, stats = self._stash.pop(transfer_id)
        if on_layer is not None:
            for layer in range(payload.num_layers):
                on_layer(layer, payload.kv[layer])
        return payload, stats

    def _recv_meta(self, deadline: float | None, timeout: float | None) -> dict:
        # gloo's own wait timeout closes the pair, so the header is awaited on a helper thread
        # and a timeout here leaves it posted for the next call.
        if self._header is None:
            length = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._header = _Arrival(dist.irecv(length, self.peer, self.group), length), length
        arrival, length = self._header
        if not arrival.done.wait(
            None if deadline is None else max(0.0, deadline - time.monotonic())
        ):
            raise TimeoutError(f"no KV transfer from rank {self.peer} in {timeout} s")
        self._header = None
        if arrival.error is not None:
            raise arrival.error
        meta = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        dist.recv(meta, self.peer, self.group)
        return json.loads(bytes(meta.cpu().numpy()))

    def _recv_layers(
        self, meta: dict, on_layer: LayerSink | None
    ) -> tuple[KVPayload, TransferStats]:
        start = time.perf_counter()
        payload = empty_like_meta(meta, self.device)
        works = [
            dist.irecv(as_bytes(payload.kv[layer]), self.peer, self.group)
            for layer in self._layers(payload)
        ]
        stats = TransferStats(payload.num_bytes)
        for layer, work in enumerate(works):
            work.wait()
            if on_layer is not None:
                on_layer(layer, payload.kv[layer])
            stats.layer_seconds.append(time.perf_counter() - start)
        self._sync()
        stats.seconds = time.perf_counter() - start
        log.debug(
            "kv recv %s from rank %d: %d bytes in %.2f ms (%.2f GB/s)",
            meta["transfer_id"],
            self.peer,
            stats.num_bytes,
            stats.seconds * 1e3,
            stats.gbps,
        )
        return payload, stats

    def _isend(self, t: torch.Tensor) -> dist.Work:
        return dist.isend(t, self.peer, self.group)

    @staticmethod
    def _layers(payload: KVPayload) -> range:
        return range(payload.num_layers if payload.num_bytes else 0)  # no zero-byte messages

    def _sync(self) -> None:
        """NCCL's wait() only orders the current stream: wait for the bytes for honest timings."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


class _Arrival:
    """Waits for a posted receive on a daemon thread; `done` is set on arrival or failure."""

    def __init__(self, work: dist.Work, buf: torch.Tensor) -> None:
        self.done, self.error = threading.Event(), None
        threading.Thread(
            target=self._wait, args=(work, buf), name="kv-recv-header", daemon=True
        ).start()

    def _wait(self, work: dist.Work, buf: torch.Tensor) -> None:
        try:
            work.wait()
            if buf.is_cuda:  # NCCL's wait only orders the stream: block until the bytes are here
                torch.cuda.current_stream(buf.device).synchronize()
        except Exception as e:  # the peer went away: the caller sees it
            self.error = e
        self.done.set()
