"""An instance's KV transports, by peer: shared memory (peer None, one host) always, and once
the instance has joined a torch.distributed group, one `TorchDistTransport` per peer rank.

Each torch.distributed link runs every send and receive on a thread of its own: NCCL wants one
thread per communicator, and a blocking point-to-point send waits for its peer's receive, so a
transfer to one peer never queues behind another peer's. Shared-memory transfers run on a small
pool of their own (a receive may wait for its file). `send` and `recv` return futures, so the
engine thread that starts a transfer never waits for the peer; the two legs of a transfer run
concurrently (the prefill side sends while the decode side receives)."""

from __future__ import annotations

import datetime
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from tandem.executor.kv_transfer.base import KVTransport, LayerSink
from tandem.executor.kv_transfer.payload import KVPayload, TransferStats
from tandem.executor.kv_transfer.shm import ShmTransport
from tandem.executor.kv_transfer.torch_dist import TorchDistTransport, init_kv_group

SHM_THREADS = 8  # shared-memory transfers at once (a decode leg's receive waits for its file)


class KVLinks:
    def __init__(self, shm: ShmTransport | None = None) -> None:
        self.shm = shm or ShmTransport()
        self.pool = ThreadPoolExecutor(
            SHM_THREADS, thread_name_prefix="kv-shm"
        )  # shm transfers, group joins
        self.rank: int | None = None
        self._links: dict[int, tuple[TorchDistTransport, ThreadPoolExecutor]] = {}
        self._lock = threading.Lock()

    def join(
        self,
        rank: int,
        world_size: int,
        host: str,
        port: int,
        backend: str | None = None,
        timeout_s: float = 120.0,
        device: torch.device | None = None,
    ) -> None:
        """Join the group whose rendezvous store listens at host:port (the launcher serves it).
        Blocks until every rank has joined. NCCL when `device` is CUDA (unless `backend` says
        otherwise), else gloo; a second join must repeat the first one's rank."""
        if self.rank is not None or dist.is_initialized():
            if rank != self.rank:
                raise ValueError(
                    f"already in a KV transfer group as rank {self.rank}, asked to join as {rank}"
                )
            return
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a group of {world_size}")
        cuda = device is not None and device.type == "cuda"
        backend = backend or ("nccl" if cuda else "gloo")
        if backend == "nccl" and not cuda:
            raise ValueError("the nccl backend needs the KV cache on a GPU; use gloo")
        if cuda:
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        init_kv_group(rank, world_size, backend=backend, store=store, timeout=timeout)
        self.rank = rank

    def transport(self, peer: int | None) -> tuple[KVTransport, ThreadPoolExecutor]:
        """The transport to `peer` and the thread(s) that drive it; ValueError for a peer there
        is no link to."""
        if peer is None:
            return self.shm, self.pool
        if self.rank is None:
            raise ValueError(
                f"KV transfer to rank {peer} asked for, but this instance is in no group"
            )
        if peer == self.rank or not 0 <= peer < dist.get_world_size():
            raise ValueError(f"no KV link from rank {self.rank} to rank {peer}")
        with self._lock:
            if peer not in self._links:
                self._links[peer] = (
                    TorchDistTransport(peer),
                    ThreadPoolExecutor(1, thread_name_prefix=f"kv-link-{peer}"),
                )
            return self._links[peer]

    def send(self, peer: int | None, transfer_id: str, payload: KVPayload) -> Future[TransferStats]:
        conn, thread = self.transport(peer)
        return thread.submit(conn.send, transfer_id, payload)

    def recv(
        self,
        peer: int | None,
        transfer_id: str,
        timeout: float | None = None,
        on_layer: LayerSink | None = None,
    ) -> Future[tuple[KVPayload, TransferStats]]:
        conn, thread = self.transport(peer)
        return thread.submit(conn.recv, transfer_id, timeout, on_layer)
