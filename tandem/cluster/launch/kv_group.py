"""`kv_transfer: {connector: torch_dist}`: every chat instance joins one torch.distributed group
(gloo on CPU, NCCL on GPU), so a prefill instance on one host can hand KV to a decode instance
on another. The launching process serves the group's rendezvous store (a TCPStore) and tells
each instance its rank over HTTP (POST /tandem/kv_group); the same works for local processes,
Ray actors and instances given by URL. The router then names the peer rank of each transfer."""

from __future__ import annotations

import datetime
import logging
from concurrent.futures import ThreadPoolExecutor

import httpx

from tandem.cluster.config import ClusterConfig
from tandem.cluster.router.pool import Instance

log = logging.getLogger(__name__)


def join_kv_group(cfg: ClusterConfig, instances: list[Instance], host: str):
    """Serve the store at `host` (kv_transfer.host wins), have every chat instance join, set
    their `kv_rank`. Returns the store, which must live as long as the group (None for shm).
    Raises RuntimeError naming each instance that could not join."""
    kt = cfg.kv_transfer
    members = [i for i in instances if i.kind == "chat"]
    if kt.connector != "torch_dist" or not members:
        return None
    import torch.distributed as dist

    host = kt.host or host
    store = dist.TCPStore(
        host,
        kt.port,
        len(members),
        is_master=True,
        timeout=datetime.timedelta(seconds=kt.timeout_s),
        wait_for_workers=False,
    )
    body = {
        "world_size": len(members),
        "host": host,
        "port": store.port,
        "backend": kt.backend,
        "timeout_s": kt.timeout_s,
    }

    def join(rank: int) -> str | None:
        inst = members[rank]
        try:
            r = httpx.post(
                inst.url + "/tandem/kv_group",
                json={**body, "rank": rank},
                timeout=kt.timeout_s + 10,
                trust_env=False,
            )
        except httpx.HTTPError as e:
            return f"{inst.id}: {type(e).__name__}: {e}"
        return None if r.status_code == 200 else f"{inst.id}: {r.status_code} {r.text[:300]}"

    with ThreadPoolExecutor(len(members)) as pool:  # a join returns only once every rank has joined
        errors = [e for e in pool.map(join, range(len(members))) if e]
    if errors:
        raise RuntimeError("KV transfer group (torch_dist) not formed: " + "; ".join(errors))
    for rank, inst in enumerate(members):
        inst.kv_rank = rank
    log.info(
        "KV transfer group: %d instances over %s, store at %s:%d",
        len(members),
        kt.backend or "auto",
        host,
        store.port,
    )
    return store
