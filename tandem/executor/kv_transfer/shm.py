"""Shared memory between processes on one host, with no server: each transfer is one file in
a RAM-backed folder (/dev/shm, the POSIX shared-memory namespace on Linux), named from the
transfer id. The sender writes it under a temporary name and renames it when complete, so a
receiver never sees a partial transfer and no flag is polled. The receiver unlinks it on open
and maps it: the payload it returns is a view of the shared pages (no copy), freed with it.

Plain files rather than `multiprocessing.shared_memory`: that module's resource tracker
unlinks a segment when its creating process exits, before a slow receiver has read it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import tempfile
import time
from pathlib import Path

import torch

from tandem.executor.kv_transfer.base import LayerSink
from tandem.executor.kv_transfer.payload import KVPayload, TransferStats, as_bytes, empty_like_meta

log = logging.getLogger(__name__)
_ALIGN = 64  # the data starts 64-byte aligned, so a mapped tensor is aligned too


class ShmTransport:
    def __init__(self, root: str | Path | None = None) -> None:
        default = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.root = Path(root or default)

    def path(self, transfer_id: str) -> Path:
        return self.root / f"tandem-kv-{hashlib.sha1(transfer_id.encode()).hexdigest()[:24]}"

    def send(self, transfer_id: str, payload: KVPayload) -> TransferStats:
        start = time.perf_counter()
        path = self.path(transfer_id)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        meta = json.dumps(payload.meta(transfer_id)).encode()
        stats = TransferStats(payload.num_bytes)
        try:
            with open(tmp, "xb") as f:
                head = len(meta).to_bytes(8, "little") + meta
                f.write(head + bytes(-len(head) % _ALIGN))
                for layer in range(payload.num_layers):
                    f.write(
                        as_bytes(payload.kv[layer]).cpu().numpy()
                    )  # a GPU payload bounces via host here
                    stats.layer_seconds.append(time.perf_counter() - start)
            os.rename(tmp, path)  # atomic publish
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        stats.seconds = time.perf_counter() - start
        log.debug(
            "kv send %s via shm: %d bytes in %.2f ms (%.2f GB/s)",
            transfer_id,
            stats.num_bytes,
            stats.seconds * 1e3,
            stats.gbps,
        )
        return stats

    def recv(
        self, transfer_id: str, timeout: float | None = None, on_layer: LayerSink | None = None
    ) -> tuple[KVPayload, TransferStats]:
        path = self.path(transfer_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 1e-5
        while True:
            try:
                f = open(path, "rb")
                break
            except FileNotFoundError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"KV transfer {transfer_id!r} did not arrive in {timeout} s"
                    ) from None
                time.sleep(delay)
                delay = min(2 * delay, 1e-3)
        start = time.perf_counter()
        with f:
            os.unlink(path)  # the name goes now; the pages live while the mapping does
            size = os.fstat(f.fileno()).st_size
            # Private and writable, for torch; read faults map the shared pages, nothing is copied.
            mm = mmap.mmap(
                f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        head = int.from_bytes(mm[:8], "little")
        meta = json.loads(mm[8 : 8 + head])
        if meta["transfer_id"] != transfer_id:
            raise RuntimeError(
                f"shm file {path} holds transfer {meta['transfer_id']!r}, not {transfer_id!r}"
            )
        payload = empty_like_meta(meta)
        offset = 8 + head + (-(8 + head) % _ALIGN)
        if payload.num_bytes:
            if size - offset != payload.num_bytes:
                raise RuntimeError(f"KV transfer {transfer_id!r} is truncated")
            data = torch.frombuffer(mm, dtype=torch.uint8, count=payload.num_bytes, offset=offset)
            payload.kv = data.view(payload.kv.dtype).view(payload.kv.shape)
        stats = TransferStats(payload.num_bytes)
        for layer in range(payload.num_layers):
            if on_layer is not None:
                on_layer(layer, payload.kv[layer])
            stats.layer_seconds.append(time.perf_counter() - start)
        stats.seconds = time.perf_counter() - start
        log.debug(
            "kv recv %s via shm: %d bytes in %.2f ms (%.2f GB/s)",
            transfer_id,
            stats.num_bytes,
            stats.seconds * 1e3,
            stats.gbps,
        )
        return payload, stats
