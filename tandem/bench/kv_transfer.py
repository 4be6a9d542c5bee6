"""`tandem bench kv-transfer`: latency and bandwidth of moving one request's KV between two
processes over each connector. Ping-pong: rank 0 sends a payload, rank 1 receives it whole
and sends it back; one-way time is half the round trip, so it includes both sides' copies.
Default shape: SmolLM2-135M (30 layers, 3 KV heads, head_dim 64, bf16, blocks of 16 tokens)."""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp

from tandem.executor.kv_transfer import KVPayload, ShmTransport, TorchDistTransport, init_kv_group


def _pingpong(
    rank: int, kind: str, tokens: list[int], shape: dict, repeats: int, port: int, out
) -> None:
    torch.set_num_threads(1)  # one copying thread per side, as a transfer thread beside an engine
    device = torch.device(shape["device"] if kind != "nccl" else f"cuda:{rank}")
    if kind in ("gloo", "nccl"):
        if kind == "nccl":
            torch.cuda.set_device(device)
        init_kv_group(rank, 2, f"tcp://127.0.0.1:{port}", backend=kind)
        conn = TorchDistTransport(peer=1 - rank)
    else:
        conn = ShmTransport()
    bs, rows = shape["block_size"], []
    for n in tokens:
        kv = torch.randn(
            shape["layers"], 2, n // bs, bs, shape["kv_heads"], shape["head_dim"], device=device
        )
        payload = KVPayload(list(range(n // bs * bs)), bs, kv.to(getattr(torch, shape["dtype"])))
        times = []
        for r in range(repeats + 1):  # the first round warms up (connections, page faults)
            tid = f"{n}-{r}"
            if rank == 0:
                start = time.perf_counter()
                conn.send(tid, payload)
                conn.recv(tid + "-back", timeout=60)
                times.append((time.perf_counter() - start) / 2)
            else:
                got, _ = conn.recv(tid, timeout=60)
                conn.send(tid + "-back", got)
        if rank == 0:
            one_way = statistics.median(times[1:])
            rows.append(
                {
                    "connector": kind,
                    "device": str(device.type),
                    "tokens": n,
                    "bytes": payload.num_bytes,
                    "latency_ms": one_way * 1e3,
                    "min_ms": min(times[1:]) * 1e3,
                    "gbps": payload.num_bytes / one_way / 1e9,
                }
            )
    if rank == 0:
        out.put(rows)
    if kind in ("gloo", "nccl"):
        torch.distributed.destroy_process_group()


def measure(
    kind: str,
    tokens: list[int],
    repeats: int = 10,
    layers: int = 30,
    kv_heads: int = 3,
    head_dim: int = 64,
    dtype: str = "bfloat16",
    block_size: int = 16,
    device: str = "cpu",
) -> list[dict]:
    """One row per payload size: one-way latency (median, min) and bandwidth, between two
    local processes over `kind` (shm | gloo | nccl; nccl needs two GPUs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shape = dict(
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        block_size=block_size,
        device=device,
    )
    out = mp.get_context("spawn").Queue()
    mp.spawn(_pingpong, args=(kind, tokens, shape, repeats, port, out), nprocs=2)
    return out.get(timeout=10)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connectors", default="shm,gloo", help="comma-separated: shm, gloo, nccl")
    p.add_argument("--tokens", default="16,64,256,1024,2048", help="payload sizes in tokens")
    p.add_argument(
        "--repeats",
        type=int,
        default=10,
        help="transfers timed per size; the median is kept (default 10)",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=30,
        help="layers of the KV shape moved (default 30, SmolLM2-135M's)",
    )
    p.add_argument("--kv-heads", type=int, default=3, help="KV heads per layer (default 3)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension (default 64)")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        help="KV dtype: bfloat16 | float16 | float32 (default bfloat16)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument(
        "--device",
        default="cpu",
        help="where the payload lives (cuda: shm and gloo bounce via host)",
    )
    p.add_argument("--json", help="write the rows here")


def main(args: argparse.Namespace) -> None:
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    print(
        f"{'connector':<10}{'device':<8}{'tokens':>8}{'MiB':>9}"
        f"{'latency ms':>12}{'min ms':>9}{'GB/s':>8}"
    )
    for kind in args.connectors.split(","):
        for row in measure(
            kind,
            tokens,
            args.repeats,
            args.layers,
            args.kv_heads,
            args.head_dim,
            args.dtype,
            args.block_size,
            args.device,
        ):
            rows.append(row)
            print(
                f"{row['connector']:<10}{row['device']:<8}{row['tokens']:>8}"
                f"{row['bytes'] / 2**20:>9.2f}"
                f"{row['latency_ms']:>12.3f}{row['min_ms']:>9.3f}{row['gbps']:>8.2f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
